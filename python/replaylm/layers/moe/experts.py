"""The experts' computation: the fused Triton kernels on the GPU (under torch.compile too, as an
opaque custom op: the torch code finds each expert's tokens with a host sync, which neither
Inductor nor a CUDA graph can take), the torch code elsewhere and inside `native_only()`.

FP8 experts take the same routes: the kernels run them w8a8 (e4m3 GEMMs, their inputs quantized
as the torch code quantizes them), the torch code emulates them on the CPU."""

from __future__ import annotations

import torch

from replaylm.layers.kernels import use_opaque_kernel
from replaylm.layers.moe.routed_rows import RoutedRows
from replaylm.layers.moe.torch_experts import Fp8ExpertScales, torch_experts


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp8: Fp8ExpertScales | None = None,
    defer_sum: bool = False,
) -> torch.Tensor | RoutedRows:
    """`hidden` `[T, H]` through its routed experts (`torch_experts` gives the contract; `fp8`:
    the scales of FP8 weights): the fused Triton kernels where `use_opaque_kernel(hidden)` (no
    host sync: graph-capturable; with `defer_sum` their sorted route may return the rows before
    the weighted sum, `RoutedRows`), else the torch code."""
    if use_opaque_kernel(hidden):
        # imported here: triton is optional, and only this route needs it
        from replaylm.layers.moe.triton_experts import triton_fused_experts

        return triton_fused_experts(hidden, w13, w2, topk_weights, topk_ids, fp8, defer_sum)
    return torch_experts(hidden, w13, w2, topk_weights, topk_ids, fp8)
