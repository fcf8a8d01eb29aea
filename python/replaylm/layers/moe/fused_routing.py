"""The router's softmax, top-k, renormalisation, id shift and token count in one Triton launch
(one program per token): in torch they are about ten small kernels a layer, which dominate a
small decode step's MoE layers. Numerics as `routing.select_experts`: float32 softmax, the k
largest in descending order (ties: the lower expert id), renormalised by their sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers


@triton.jit
def _route_kernel(
    Logits,
    Weights,
    Ids,
    Counts,
    Slots,
    stride_t,
    num_experts,
    first_expert,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producers(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(Logits + t * stride_t + e, mask=e < num_experts, other=float("-inf"))
    p = tl.exp(logits.to(tl.float32) - tl.max(logits.to(tl.float32), axis=0))
    p = p / tl.sum(p, axis=0)
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        expert = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        weights = tl.where(slot == j, best, weights)
        ids = tl.where(slot == j, expert, ids)
        p = tl.where(e == expert, -1.0, p)  # below every probability: not taken again
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # slots past TOP_K hold 0
    kept = slot < TOP_K
    tl.store(Weights + t * TOP_K + slot, weights, mask=kept)
    tl.store(Ids + t * TOP_K + slot, ids - first_expert, mask=kept)
    live = tl.full((BLOCK_K,), 1, tl.int64)
    if HAS_SLOTS:
        live = live * (tl.load(Slots + t) != 0).to(tl.int64)
    tl.atomic_add(Counts + ids, live, mask=kept)


def fused_route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    slots: torch.Tensor | None,
    first_expert: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32, ids `[T, k]` int32 less `first_expert`) of `router_logits`
    `[T, E]` (its rows contiguous), adding each pair to `counts` `[E]` (int64, global ids) unless
    its token's slot in `slots` `[T]` is 0. No host sync: graph-capturable."""
    tokens, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    if tokens == 0:
        return weights, ids
    _route_kernel[(tokens,)](
        router_logits,
        weights,
        ids,
        counts,
        counts if slots is None else slots,
        router_logits.stride(0),
        num_experts,
        first_expert,
        TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        HAS_SLOTS=slots is not None,
        num_warps=1 if num_experts <= 128 else 4,
        **pdl_launch(),
    )
    return weights, ids
