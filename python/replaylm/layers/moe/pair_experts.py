"""The experts of a few tokens without the sort: each routed (token, slot) pair runs on its own
expert (`triton_experts` takes this route for batches of up to `PAIR_TOKENS` tokens).

At a decode step of one to a few tokens nearly every pair reaches a different expert, so sorting
the pairs into blocks by expert saves no weight read; it costs a launch, and so does summing the
k rows back. Here two launches do it all:
- gate_up: one program per (column tile, pair) multiplies the pair's token row by its expert's
  interleaved gate and up rows, SiluAndMul in the epilogue (the skinny matmul's tile code, one
  row of the 16-row tile live);
- down: one program per (column tile, token, slot) multiplies the pair's intermediate row by its
  expert's down rows, rounds the product to the input dtype and weights it in float32 (as the
  weighted sum of the sorted route does); the last of a tile's k programs to arrive sums the
  k rows in slot order and writes the token's output (the skinny matmul's split-K arrival, its
  workspace shared: the slots are the slices).

An id outside 0..E-1 (an expert another rank holds) adds nothing. No host sync: CUDA graphs
capture it. bf16/fp16/fp32 weights; FP8 experts take the sorted route.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.attention.triton.common import dot_precision
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.kernels.skinny_matmul import (
    MatmulConfig,
    slice_product,
    split_k_workspace,
    weight_rows,
    write_tile,
)

PAIR_TOKENS = 2  # the most tokens this route takes: docs/tuning.md, "MoE pair kernels"


@triton.jit
def _pair_product(
    X,
    W,
    offs_n,
    N,
    K,
    stride_wn,
    BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
):
    """`X`'s one row by W's rows `offs_n` over all `BLOCKS` blocks of K (`slice_product`, its
    producers already waited for): a float32 tile whose rows past the first are zero."""
    return slice_product(
        X,
        W,
        tl.arange(0, BLOCK_M),
        offs_n,
        0,
        1,
        N,
        K,
        0,
        stride_wn,
        BLOCKS,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
        SWAP,
        False,
    )


@triton.jit
def _pair_gate_up_kernel(
    X,
    W13,
    Ids,
    Act,
    N,
    K,
    num_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Act[pair, tile's columns] = silu(gate) * up of X[pair // TOP_K] by its expert's W13."""
    pid_n = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    wait_for_producers(USE_PDL)
    expert = tl.load(Ids + pair)
    if (expert < 0) | (expert >= num_experts):
        return
    offs_n = weight_rows(pid_n, N, BLOCK_N, True)
    acc = _pair_product(
        X + (pair // TOP_K) * stride_xm,
        W13 + expert.to(tl.int64) * stride_we,
        offs_n,
        N,
        K,
        stride_wn,
        BLOCKS,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
        SWAP,
    )
    row = Act + pair * stride_am
    offs_m = tl.arange(0, BLOCK_M)
    write_tile(
        row,
        row,
        row,
        acc,
        offs_m,
        offs_n,
        pid_n,
        1,
        N,
        0,
        False,
        True,
        BLOCK_M,
        BLOCK_N,
        row,
        False,
    )


@triton.jit
def _pair_down_kernel(
    Act,
    W2,
    Ids,
    Weights,
    Out,
    Partials,
    Arrivals,
    N,
    K,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Out[token, tile's columns] = sum over slots s of Weights[pair] * (Act[pair] @ W2[expert]^T)
    rounded to Out's dtype, pair = token * TOP_K + s, in slot order."""
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    slot = tl.program_id(2)
    pair = token * TOP_K + slot
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wait_for_producers(USE_PDL)
    expert = tl.load(Ids + pair)
    y = tl.zeros((BLOCK_N,), tl.float32)
    if (expert >= 0) & (expert < num_experts):
        acc = _pair_product(
            Act + pair * stride_am,
            W2 + expert.to(tl.int64) * stride_we,
            offs_n,
            N,
            K,
            stride_wn,
            BLOCKS,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            SWAP,
        )
        product = tl.sum(acc, axis=0).to(Out.dtype.element_ty).to(tl.float32)
        y = tl.load(Weights + pair) * product
    parts = Partials + token * (TOP_K * N) + offs_n
    tl.store(parts + slot * N, y, mask=offs_n < N)
    tl.debug_barrier()
    counter = Arrivals + token * tl.num_programs(0) + pid_n
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == TOP_K - 1:  # the token's last slot for this tile: sum in slot order
        tl.store(counter, 0)
        total = tl.zeros((BLOCK_N,), tl.float32)
        for s in range(0, TOP_K):
            total += tl.load(parts + s * N, mask=offs_n < N, other=0.0, cache_modifier=".cg")
        tl.store(Out + token * stride_om + offs_n, total.to(Out.dtype.element_ty), mask=offs_n < N)


def pair_configs() -> tuple[MatmulConfig, MatmulConfig]:
    """The (gate_up, down) launches: 32- and 64-column tiles over 128-column blocks of K, which
    a sweep at Qwen3-30B-A3B's shape found best or within noise of it at 1 to 8 tokens, and K
    never split (docs/tuning.md, "MoE pair kernels")."""
    return (
        MatmulConfig(32, 128, 1, num_warps=4, num_stages=3),
        MatmulConfig(64, 128, 1, num_warps=4, num_stages=3),
    )


def pair_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[MatmulConfig, MatmulConfig] | None = None,
) -> torch.Tensor:
    """`torch_experts`' contract in two launches for `hidden` `[T, H]` (rows contiguous),
    `topk_weights` float32 and `topk_ids` int32 `[T, k]` (contiguous), non-FP8 weights.
    `configs`: the (gate_up, down) launches (default `pair_configs`; K is never split: the
    `split_k` of both is 1). ValueError where the split-K workspace cannot take T tokens."""
    tokens, width = hidden.shape
    num_experts, intermediate, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    gate_up, down = configs or pair_configs()
    pairs, tiles = tokens * top_k, triton.cdiv(width, down.block_n)
    partials, arrivals = split_k_workspace(hidden.device)
    if pairs * width > partials.numel() or tokens * tiles > arrivals.numel():
        raise ValueError(f"{tokens} tokens of {top_k} experts exceed the split-K workspace")
    out = torch.empty_like(hidden)
    act = hidden.new_empty((pairs, intermediate))
    precision = dot_precision(hidden.dtype)
    _pair_gate_up_kernel[(triton.cdiv(intermediate, gate_up.block_n // 2), pairs)](
        hidden,
        w13,
        topk_ids,
        act,
        2 * intermediate,
        width,
        num_experts,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=top_k,
        BLOCKS=triton.cdiv(width, gate_up.block_k),
        PRECISION=precision,
        **gate_up.launch(),
    )
    _pair_down_kernel[(tiles, tokens, top_k)](
        act,
        w2,
        topk_ids,
        topk_weights,
        out,
        partials,
        arrivals,
        width,
        intermediate,
        num_experts,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        TOP_K=top_k,
        BLOCKS=triton.cdiv(intermediate, down.block_k),
        PRECISION=precision,
        **down.launch(),
    )
    return out
