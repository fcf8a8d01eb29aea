"""The router's matmul and the routing in one Triton launch, for a decode step's few tokens.

At up to `MAX_ROWS` tokens the router's `[T, H] x [E, H]^T` runs as the skinny matmul runs it
(the same launch config, tile code and split-K merge: the same logits bit for bit), each tile's
logits rounded to the hidden states' dtype as the router's output is. The last tile to arrive
on one more counter of the split-K workspace then routes every token: the softmax, top-k,
renormalisation, id shift and count of `fused_routing.py`, all rows at once. That saves the
routing's own launch, one of the few a small decode step's MoE layer takes. No host sync: CUDA
graphs capture it.

The rest of a decode batch, up to `SPLIT_ROUTER_ROWS` tokens, takes the skinny matmul alone (the
same tiles over each 16 tokens, K split as at decode rows, so a token's logits do not depend on
its batch up to there) and then the routing's launch. cuBLAS reads the router's small weight
slower, and one launch for both does not pay past 16 tokens (docs/tuning.md, "LM head above 16
rows").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from replaylm.layers.attention.triton.common import dot_precision
from replaylm.layers.kernels import as_rows
from replaylm.layers.kernels.skinny_matmul import (
    MAX_ROWS,
    matmul_config,
    merge_slices,
    skinny_matmul,
    slice_product,
    split_k_workspace,
    weight_rows,
)
from replaylm.layers.moe.fused_routing import fused_route, live_rows, route_rows, store_routes

SPLIT_ROUTER_ROWS = 256  # the most tokens whose router runs on the skinny matmul (a decode batch)


# one variant for every batch size: the token count is not specialized
@triton.jit(do_not_specialize=["M"])
def _router_kernel(
    X,
    W,
    Logits,
    Weights,
    Ids,
    Counts,
    Slots,
    Partials,
    Arrivals,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    first_expert,
    BLOCKS_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Logits tile `program_id(0)` over K slice `program_id(1)`; the last tile to arrive on
    `Arrivals[num_programs(0)]` routes all M tokens."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = weight_rows(pid_n, N, BLOCK_N, False)
    acc = slice_product(
        X,
        W,
        offs_m,
        offs_n,
        pid_k * BLOCKS_PER_SPLIT,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        BLOCKS_PER_SPLIT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
        SWAP,
        USE_PDL,
    )
    last = True
    if SPLIT_K > 1:
        last, acc = merge_slices(acc, Partials, Arrivals, pid_n, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)
    if last:  # this tile's logits are whole: store them, then arrive on the tiles' counter
        rows_ok = offs_m[:, None] < M
        tl.store(
            Logits + offs_m[:, None] * N + offs_n[None, :],
            acc.to(Logits.dtype.element_ty),
            mask=rows_ok & (offs_n[None, :] < N),
        )
        tl.debug_barrier()
        counter = Arrivals + tl.num_programs(0)
        if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.store(counter, 0)
            e = tl.arange(0, BLOCK_E)[None, :]
            logits = tl.load(
                Logits + offs_m[:, None] * N + e,
                mask=rows_ok & (e < N),
                other=0.0,
                cache_modifier=".cg",
            ).to(tl.float32)
            logits = tl.where(e < N, logits, float("-inf"))
            weights, ids = route_rows(logits, BLOCK_E, TOP_K, BLOCK_TOP_K, RENORMALIZE)
            live = live_rows(Slots, offs_m, M, HAS_SLOTS)
            store_routes(
                weights, ids, offs_m, live, Weights, Ids, Counts, first_expert, TOP_K, BLOCK_TOP_K
            )


def fused_router(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    slots: torch.Tensor | None,
    first_expert: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_route(hidden @ weight.T, ...)`'s (weights `[T, k]` float32, ids `[T, k]` int32
    less `first_expert`), adding each pair to `counts` `[E]` unless its token's slot in `slots`
    is 0, for `hidden` `[T, H]` (unit column stride) of at most MAX_ROWS tokens and the router's
    `weight` `[E, H]` (contiguous). ValueError for more tokens."""
    tokens, width = hidden.shape
    num_experts = weight.shape[0]
    if tokens > MAX_ROWS:
        raise ValueError(f"the fused router takes at most {MAX_ROWS} tokens, not {tokens}")
    device = hidden.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    if tokens == 0:
        return weights, ids
    cfg = matmul_config(num_experts, width)
    tiles = triton.cdiv(num_experts, cfg.block_n)
    partials, arrivals = split_k_workspace(device)
    logits = hidden.new_empty((tokens, num_experts))
    _router_kernel[(tiles, cfg.split_k)](
        hidden,
        weight,
        logits,
        weights,
        ids,
        counts,
        counts if slots is None else slots,
        partials,
        arrivals,
        tokens,
        num_experts,
        width,
        hidden.stride(0),
        weight.stride(0),
        first_expert,
        BLOCKS_PER_SPLIT=triton.cdiv(triton.cdiv(width, cfg.block_k), cfg.split_k),
        SPLIT_K=cfg.split_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        TOP_K=top_k,
        BLOCK_TOP_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        HAS_SLOTS=slots is not None,
        PRECISION=dot_precision(hidden.dtype),
        **cfg.launch(),
    )
    return weights, ids


def route_hidden_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    slots: torch.Tensor | None,
    first_expert: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_router` at up to MAX_ROWS tokens, else the router's matmul then `fused_route`:
    up to SPLIT_ROUTER_ROWS tokens the skinny matmul's split-K launch, past them `F.linear` (as
    the skinny-matmul router takes them)."""
    rows = as_rows(hidden, hidden.shape[-1])
    tokens = rows.shape[0]
    if tokens <= MAX_ROWS:
        return fused_router(rows, weight, top_k, renormalize, counts, slots, first_expert)
    logits = skinny_matmul(rows, weight) if tokens <= SPLIT_ROUTER_ROWS else F.linear(rows, weight)
    return fused_route(logits, top_k, renormalize, counts, slots, first_expert)
