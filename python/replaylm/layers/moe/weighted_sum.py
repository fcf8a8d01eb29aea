"""The last launch of a mixture of experts' sorted route: each token's expert rows weighted and
summed back in token order (where the residual-add RMSNorm after the layer does not take the sum
into its own launch: `kernels.rmsnorm.rms_norm_of_expert_sum`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.moe.routed_rows import RoutedRows

_SUM_BLOCK = 1024  # columns per program


@triton.jit
def _weighted_sum_kernel(
    Y,
    Weights,
    Ids,
    Out,
    H,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Out[t] = sum over slots s of Weights[t, s] * Y[t * TOP_K + s] in float32, slots of
    experts outside 0..num_experts-1 skipped (their rows of Y were never written)."""
    wait_for_producers(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(TOP_K):
        pair = token * TOP_K + s
        expert = tl.load(Ids + pair)
        if (expert >= 0) & (expert < num_experts):
            y = tl.load(Y + pair * H + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc += tl.load(Weights + pair) * y
    tl.store(Out + token * H + cols, acc.to(Out.dtype.element_ty), mask=col_ok)


def weighted_sum(routed: RoutedRows) -> torch.Tensor:
    """The tokens' outputs `[T, H]` of `routed`: each one's expert rows weighted and summed in
    float32, rounded once to the rows' dtype."""
    tokens, top_k = routed.ids.shape
    width = routed.rows.shape[1]
    out = routed.rows.new_empty((tokens, width))
    _weighted_sum_kernel[(tokens, triton.cdiv(width, _SUM_BLOCK))](
        routed.rows,
        routed.weights,
        routed.ids,
        out,
        width,
        routed.num_experts,
        TOP_K=top_k,
        BLOCK=_SUM_BLOCK,
        num_warps=4,
        **pdl_launch(),
    )
    return out
