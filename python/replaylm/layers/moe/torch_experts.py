"""The experts' computation in torch: each expert's SwiGLU MLP over the tokens routed to it,
weighted and summed back in token order. The CPU's path and the reference of the Triton
kernels; it finds each expert's tokens with a host sync, so it is not graph-capturable."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`hidden` `[T, H]` through the routed experts: `w13` `[E, 2I, H]` (gate rows, then up
    rows), `w2` `[E, H, I]`, `topk_weights` / `topk_ids` `[T, k]` (an id outside 0..E-1 is an
    expert held by another rank: it adds nothing). `[T, H]` in `hidden`'s dtype; each product
    is taken in that dtype and the weighted sum in float32."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    num_experts = w13.shape[0]
    for expert in topk_ids.unique().tolist():
        if not 0 <= expert < num_experts:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(hidden[token], w13[expert]).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token, down.float() * topk_weights[token, slot, None])
    return out.to(hidden.dtype)
