"""The experts' computation in fused Triton kernels (the GPU's route of `fused_experts`).

The routed (token, slot) pairs are sorted by expert into blocks of `block_m` rows
(`moe_align`); a grouped GEMM gives each program one block of one expert, its A rows gathered
from the pairs' tokens. It runs twice: gate_up with SiluAndMul in its epilogue (a tile
interleaves gate and up rows of the same columns), then down; a last kernel sums each token's k
rows weighted by the router in float32, skipping other ranks' experts. Five launches, no host
sync, buffers sized by T, k, E and the block config alone: CUDA graphs capture it. Under
torch.compile (inside `kernels_in_compiled_code`) it is the custom op `replaylm::fused_experts`.

Same numbers as `torch_experts` up to summation order: fp32 accumulation, each product rounded to
the input dtype (SiluAndMul rounded as the torch code rounds it), the weighted sum in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.attention.triton.common import dot_precision
from replaylm.layers.kernels import as_rows, pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.moe.block_configs import (
    MoeBlockConfig,
    config_tokens,
    device_name,
    moe_block_config,
)
from replaylm.layers.moe.moe_align import moe_align_block_size

_SUM_BLOCK = 1024  # columns per program of the weighted sum


@triton.jit
def _tile_ids(pid, max_rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M):
    """(row block, column tile) of program `pid`, `GROUP_M` row blocks per group column-major,
    so consecutive programs share weight tiles in L2."""
    blocks_m = tl.cdiv(max_rows, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _weight_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """(rows of the expert's weight a tile covers, which exist): `BLOCK_N` consecutive rows, or
    with `GATED` (`[gate; up]`, N = 2I) gate row c and up row I + c interleaved for
    `BLOCK_N // 2` output columns c."""
    j = tl.arange(0, BLOCK_N)
    if GATED:
        cols = pid_n * (BLOCK_N // 2) + j // 2
        return (j % 2) * (N // 2) + cols, cols < N // 2
    rows = pid_n * BLOCK_N + j
    return rows, rows < N


@triton.jit
def _store_tile(
    C,
    acc,
    slots,
    live,
    pid_n,
    N,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GATED: tl.constexpr,
):
    """Store `acc` to the pairs' rows `slots` of C in C's dtype; with `GATED`, first
    `silu(gate) * up` over its column pairs, each step rounded as the torch code rounds it."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    width = N
    if GATED:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        g = gate.to(C.dtype.element_ty).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(C.dtype.element_ty).to(tl.float32)
        acc = silu * up.to(C.dtype.element_ty).to(tl.float32)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        width = N // 2
    ptrs = C + slots[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(ptrs, acc.to(C.dtype.element_ty), mask=live[:, None] & (cols[None, :] < width))


# one variant for every batch size: the token-dependent arguments are not specialized
@triton.jit(do_not_specialize=["num_pairs", "max_rows"])
def _grouped_gemm_kernel(
    A,
    B,
    C,
    SortedIds,
    ExpertIds,
    NumPostPad,
    N,
    K,
    num_pairs,
    max_rows,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    PAIRS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """C[pair] = A[pair // PAIRS_PER_ROW] @ B[expert]^T for the `BLOCK_M` sorted pairs of one
    block (padding rows masked); programs of blocks past the padded total exit."""
    wait_for_producers(USE_PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), max_rows, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPostPad):
        return
    slots = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = slots < num_pairs
    a_rows = A + (slots // PAIRS_PER_ROW).to(tl.int64)[:, None] * stride_am
    rows, rows_ok = _weight_rows(pid_n, N, BLOCK_N, GATED)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    b_rows = B + expert * stride_be + rows.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + offs_k[:, None], mask=k_ok[:, None] & rows_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    _store_tile(C, acc, slots, live, pid_n, N, stride_cm, BLOCK_M, BLOCK_N, GATED)


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


def _grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pairs_per_row: int,
    gated: bool,
    config: MoeBlockConfig,
) -> None:
    """Launch the grouped GEMM of `a` `[rows, K]` by `weight` `[E, N, K]` into `out`, over the
    sorted pairs `routing` (`moe_align_block_size`'s result)."""
    sorted_ids, expert_ids, num_post_pad = routing
    n, k = weight.shape[1], weight.shape[2]
    max_rows = sorted_ids.numel()
    tiles_n = triton.cdiv(n, config.block_n)
    _grouped_gemm_kernel[(triton.cdiv(max_rows, config.block_m) * tiles_n,)](
        a,
        weight,
        out,
        sorted_ids,
        expert_ids,
        num_post_pad,
        n,
        k,
        out.shape[0],
        max_rows,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        PAIRS_PER_ROW=pairs_per_row,
        GATED=gated,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        PRECISION=dot_precision(a.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch(),
    )


def _check(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> None:
    """ValueError for operands the kernels do not take."""
    num_experts, two_i, width = w13.shape
    if hidden.dim() != 2 or width != hidden.shape[1] or two_i % 2:
        raise ValueError(f"hidden {list(hidden.shape)} does not fit w13 {list(w13.shape)}")
    if w2.shape != (num_experts, width, two_i // 2):
        raise ValueError(f"w2 {list(w2.shape)} does not fit w13 {list(w13.shape)}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"weights {w13.dtype}/{w2.dtype} differ from hidden {hidden.dtype}")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("the expert weights must be contiguous along their last dim")
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {list(ids.shape)} does not fit hidden {list(hidden.shape)}")


def triton_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeBlockConfig | None = None,
) -> torch.Tensor:
    """`torch_experts`'s contract (an id outside 0..E-1 adds nothing) in five launches with no
    host sync. `config` overrides `moe_block_config`'s choice for this shape and token count."""
    _check(hidden, w13, w2, topk_ids)
    tokens, width = hidden.shape
    num_experts, intermediate, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    out = torch.empty((tokens, width), dtype=hidden.dtype, device=hidden.device)
    if tokens == 0:
        return out
    if config is None:
        place = device_name(hidden.device)
        config, _ = moe_block_config(
            num_experts, intermediate, width, config_tokens(tokens), hidden.dtype, place
        )
    ids = topk_ids.to(torch.int32).contiguous()
    routing = moe_align_block_size(ids, num_experts, config.block_m)
    act = hidden.new_empty((tokens * top_k, intermediate))
    _grouped_gemm(as_rows(hidden, width), w13, act, routing, top_k, True, config)
    down = hidden.new_empty((tokens * top_k, width))
    _grouped_gemm(act, w2, down, routing, 1, False, config)
    weights = topk_weights.to(torch.float32).contiguous()
    _weighted_sum_kernel[(tokens, triton.cdiv(width, _SUM_BLOCK))](
        down,
        weights,
        ids,
        out,
        width,
        num_experts,
        TOP_K=top_k,
        BLOCK=_SUM_BLOCK,
        num_warps=4,
        **pdl_launch(),
    )
    return out


@torch.library.custom_op("replaylm::fused_experts", mutates_args=())
def _fused_experts_op(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return triton_experts(hidden, w13, w2, topk_weights, topk_ids)


@_fused_experts_op.register_fake
def _(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


def triton_fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`triton_experts` with its own config choice: a direct call when run eagerly, the custom
    op `replaylm::fused_experts` when torch.compile traces it."""
    if not torch.compiler.is_compiling():
        return triton_experts(hidden, w13, w2, topk_weights, topk_ids)
    return torch.ops.replaylm.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
