"""RMSNorm with an optional fused residual add, and under tensor parallelism the sum over the
ranks of the partial outputs it follows; its output quantized to FP8 in the same launch where an
FP8 layer reads it."""

from __future__ import annotations

import torch
from torch import nn

from replaylm.distributed.communication import all_reduce, one_shot_peer
from replaylm.layers.kernels import use_triton_kernels
from replaylm.layers.moe.routed_rows import RoutedRows
from replaylm.layers.quantization.fp8 import Activation, QuantizesFor


class RMSNorm(nn.Module, QuantizesFor):
    """`y = x / rms(x) * weight`, computed in float32 and cast back (as HF Llama does).

    With `residual`, first `x = x + residual` and the sum is returned as the new residual.
    On the Triton route (`use_triton_kernels`) one fused kernel does it all.

    With `sum_site` set (tensor parallelism: `x` is a RowParallelLinear's partial sums, and a
    residual comes with it), `x` is first summed over the ranks: together with the add and the
    norm in one launch where `--tp-all-reduce one-shot` takes it, else by the all-reduce. The
    site numbers the model's sums in the order a forward makes them (see `PeerAllReduce`).

    `quantizes_for(layer)`: on the Triton route (outside torch.compile) the output comes
    quantized per token, from the same launch, whenever `layer` takes it so.

    `x` may be a mixture of experts' rows before their weighted sum (`RoutedRows`): with a
    residual and no sum over ranks the sum runs in the norm's launch (`rms_norm_of_expert_sum`,
    or `rms_norm_quantize` where the output comes quantized); otherwise they are summed first.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.sum_site: int | None = None

    def forward(
        self, x: torch.Tensor | RoutedRows, residual: torch.Tensor | None = None
    ) -> Activation | tuple[Activation, torch.Tensor]:
        if isinstance(x, RoutedRows):  # a mixture of experts' rows, not yet summed
            if residual is not None and self.sum_site is None:
                return self._expert_sum_norm(x, residual)
            # imported here: RoutedRows come from the Triton route alone
            from replaylm.layers.moe.weighted_sum import weighted_sum

            x = weighted_sum(x)
        if self.sum_site is not None:
            assert residual is not None  # every sum of partials is followed by a residual add
            peer = one_shot_peer(x, residual)
            if peer is not None:
                # imported here: the kernel's module imports triton, which CPU groups never need
                from replaylm.layers.kernels.peer_sum_norm import peer_sum_add_rms_norm

                return peer_sum_add_rms_norm(
                    peer, x, residual, self.weight, self.eps, self.sum_site
                )
            x = all_reduce(x)
        if use_triton_kernels(x):
            if self.quantizes() and _one_dtype(x, self.weight, residual):
                from replaylm.layers.quantization.fp8_kernels import rms_norm_quantize

                rows, summed = rms_norm_quantize(x, self.weight, self.eps, residual)
                return rows if summed is None else (rows, summed)
            from replaylm.layers.kernels.ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)

    def _expert_sum_norm(
        self, x: RoutedRows, residual: torch.Tensor
    ) -> tuple[Activation, torch.Tensor]:
        """The norm of `x`'s weighted sum plus `residual`, the sum taken in the norm's launch
        (quantized in it too where the norm `quantizes()`)."""
        # imported here: the kernels' modules import triton
        if self.quantizes() and _one_dtype(x.rows, self.weight, residual):
            from replaylm.layers.quantization.fp8_kernels import rms_norm_quantize

            experts = (x.weights, x.ids, x.num_experts)
            rows, summed = rms_norm_quantize(x.rows, self.weight, self.eps, residual, experts)
            assert summed is not None  # with a residual
            return rows, summed
        from replaylm.layers.kernels.rmsnorm import rms_norm_of_expert_sum

        return rms_norm_of_expert_sum(*x, self.weight, self.eps, residual)


def _one_dtype(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the fused norm-and-quantization takes these operands: all of one dtype."""
    return x.dtype == weight.dtype and (residual is None or residual.dtype == x.dtype)
