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
def route_rows(
    logits,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """(weights `[R, BLOCK_K]` float32, ids `[R, BLOCK_K]` int32: slots past TOP_K hold 0) of the
    router's float32 `logits` `[R, BLOCK_E]` (-inf past the experts), each row on its own."""
    e = tl.arange(0, BLOCK_E)[None, :]
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    slot = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros((logits.shape[0], BLOCK_K), tl.float32)
    ids = tl.zeros((logits.shape[0], BLOCK_K), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)[:, None]
        expert = tl.min(tl.where(p == best, e, BLOCK_E), axis=1)[:, None]
        weights = tl.where(slot == j, best, weights)
        ids = tl.where(slot == j, expert, ids)
        p = tl.where(e == expert, -1.0, p)  # below every probability: not taken again
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # slots past TOP_K hold 0
    return weights, ids


@triton.jit
def store_routes(
    weights,
    ids,
    rows,
    live,
    Weights,
    Ids,
    Counts,
    first_expert,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Store `route_rows`' result for tokens `rows` `[R]` where `live` `[R]` (int64: 1, or 0
    for a row to count nothing; -1: a row not to store), the ids less `first_expert`, and add
    each stored pair with its `live` to `Counts` (global ids)."""
    slot = tl.arange(0, BLOCK_K)[None, :]
    kept = (slot < TOP_K) & (live[:, None] >= 0)
    at = rows[:, None].to(tl.int64) * TOP_K + slot
    tl.store(Weights + at, weights, mask=kept)
    tl.store(Ids + at, ids - first_expert, mask=kept)
    tl.atomic_add(Counts + ids, tl.broadcast_to(live[:, None], ids.shape), mask=kept)


# one variant for every batch size: the token count is not specialized
@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    Logits,
    Weights,
    Ids,
    Counts,
    Slots,
    stride_t,
    num_tokens,
    num_experts,
    first_expert,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Token `program_id(0)`'s route (`route_rows`, `store_routes`)."""
    wait_for_producers(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)[None, :]
    logits = tl.load(Logits + t * stride_t + e, mask=e < num_experts, other=float("-inf"))
    weights, ids = route_rows(logits.to(tl.float32), BLOCK_E, TOP_K, BLOCK_K, RENORMALIZE)
    rows = tl.full((1,), 0, tl.int64) + t
    store_routes(
        weights,
        ids,
        rows,
        live_rows(Slots, rows, num_tokens, HAS_SLOTS),
        Weights,
        Ids,
        Counts,
        first_expert,
        TOP_K,
        BLOCK_K,
    )


@triton.jit
def live_rows(Slots, rows, M, HAS_SLOTS: tl.constexpr):
    """`store_routes`' `live` of tokens `rows`: -1 past the `M` tokens, 0 for a token whose KV
    slot in `Slots` is 0 (a CUDA graph's padding row, with `HAS_SLOTS`), else 1."""
    live = tl.where(rows < M, 1, -1).to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(Slots + rows, mask=rows < M, other=1)
        live = tl.where((live > 0) & (slot == 0), 0, live)
    return live


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
        tokens,
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
