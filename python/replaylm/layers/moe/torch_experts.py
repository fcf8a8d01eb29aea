"""The experts' computation in torch: each expert's SwiGLU MLP over the tokens routed to it,
weighted and summed back in token order. The CPU's path and the reference of the Triton
kernels; it finds each expert's tokens with a host sync, so it is not graph-capturable.

FP8 experts (`Fp8ExpertScales`) run each projection through `fp8_linear`: on the CPU its
emulation (the expert's weight dequantized per matmul, its tokens quantized per token, or per
token and block-column group, or with the layer's static scale, as the fused kernels quantize
them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replaylm.layers.quantization.fp8_linear import fp8_linear


@dataclass(frozen=True)
class Fp8ExpertScales:
    """The scales of FP8 (e4m3) experts: `w13` and `w2` per channel (`[E, 2I]`, `[E, H]`) or
    per `block_size` block (`[E, 2I/bn, ceil(H/bk)]`, `[E, ceil(H/bn), ceil(I/bk)]`); static
    input scales `w13_input` `[E, 2]` (gate, up) and `w2_input` `[E, 1]`, each projection's
    largest over all the experts taken (as vLLM and SGLang take it: the fused kernels quantize
    every token once, whichever its experts), or None: dynamic per token."""

    w13: torch.Tensor
    w2: torch.Tensor
    block_size: tuple[int, int] | None
    w13_input: torch.Tensor | None = None
    w2_input: torch.Tensor | None = None


def torch_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp8: Fp8ExpertScales | None = None,
) -> torch.Tensor:
    """`hidden` `[T, H]` through the routed experts: `w13` `[E, 2I, H]` (gate rows, then up
    rows), `w2` `[E, H, I]` (FP8 with `fp8`'s scales, or in `hidden`'s dtype), `topk_weights` /
    `topk_ids` `[T, k]` (an id outside 0..E-1 is an expert held by another rank: it adds
    nothing). `[T, H]` in `hidden`'s dtype; each product is taken in that dtype and the
    weighted sum in float32."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    num_experts = w13.shape[0]
    for expert in topk_ids.unique().tolist():
        if not 0 <= expert < num_experts:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = _project(hidden[token], w13, expert, fp8, first=True).chunk(2, dim=-1)
        down = _project(F.silu(gate) * up, w2, expert, fp8, first=False)
        out.index_add_(0, token, down.float() * topk_weights[token, slot, None])
    return out.to(hidden.dtype)


def _project(
    x: torch.Tensor, w: torch.Tensor, expert: int, fp8: Fp8ExpertScales | None, first: bool
) -> torch.Tensor:
    """`x` through expert `expert`'s first (`w13`) or second (`w2`) projection `w`."""
    if fp8 is None:
        return F.linear(x, w[expert])
    scale, inputs = (fp8.w13, fp8.w13_input) if first else (fp8.w2, fp8.w2_input)
    return fp8_linear(
        x,
        w[expert],
        scale[expert],
        fp8.block_size,
        input_scale=inputs,
    )
