"""`y = x W^T (+ b)` in a Triton kernel built for few rows (decode batches, M <= `MAX_ROWS`), and
for any M with `INVARIANT_CONFIG` (the batch-invariant matmul of `--deterministic`).

A program computes a `[BLOCK_M, BLOCK_N]` tile of `y` over one slice of K with tensor-core dots;
with `split_k > 1` (at most 16 rows) the slices' fp32 partials go to a workspace and the last
slice to arrive on its tile's counter adds them in slice order (so the sum is deterministic),
writes `y` and zeroes the counter. Narrow projections have too few output tiles to keep the GPU's
memory bandwidth busy; slicing K gives them more programs (docs/tuning.md, "Split-K skinny
matmul").

FP8 (e4m3) weights with per-output-channel scales run the same way on an e4m3 input with per-row
scales: half the weight bytes, the dots taken in FP8 on the tensor cores (no tile converted), both
scales on the float32 sums at the end (docs/tuning.md, "FP8 GEMMs"). A bf16 input is quantized per
token in the kernel (each program finds its rows' scales first, then quantizes each tile as it
loads it): no quantization launch before the matmul.

With `norm` (`NormInput`) the input is an RMSNorm's (with its residual add) that the kernel
computes itself: each program finds its rows' rstd first, normalizes each tile as it loads it,
and the programs of the first column tile write the new residual: no norm launch before the
matmul (docs/tuning.md, "Norm in the matmul"). Both reads of whole rows go a row at a time in
wide chunks; the callers take them for a few rows only.

With `gated_silu` the weight is a `[gate; up]` pair and a program's tile interleaves gate and up
rows of the same output columns, so its epilogue applies SiluAndMul and writes half as many
columns: the MLP's gate-up projection and activation in one launch, with no intermediate tensor
(docs/tuning.md, "Fused elementwise kernels").

Up to 16 rows the launch configuration never depends on M: each row of `y` is computed the same
way whatever the number of rows beside it (rows are batch-invariant: across 1..16 rows with
`matmul_config`, across any number with `INVARIANT_CONFIG`). FP8 takes up to `FP8_MAX_ROWS` rows,
past 16 in 64-row tiles (`fp8_rows_config`; FP8 is not batch-invariant in any case).

The workspace is one per device, shared by every call: calls must be stream-ordered (one stream),
as the model's forward is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replaylm.layers.attention.triton.common import dot_precision
from replaylm.layers.kernels import as_rows, pdl_launch
from replaylm.layers.kernels.e4m3 import amax_scale, scaled_e4m3
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.norm_input import NormInput

MAX_ROWS = 16  # the row tile: one program covers every row of a decode batch up to this
# FP8 rows the kernel takes: up to here it reads the weight once, faster than cuBLASLt's FP8 GEMM
FP8_MAX_ROWS = 64
# the workspace's bounds: fp32 partials of a split-K launch (tiles x slices x BLOCK_M x BLOCK_N;
# 8 MiB) and output tiles (one arrival counter each)
_PARTIAL_FLOATS, _MAX_SPLIT_TILES = 2**21, 4096
# a row's columns per load where a program reads its rows whole (the norm's rstd, the
# quantization's amax): wide, so that few dependent loads come before the first dot
_ROW_CHUNK = tl.constexpr(1024)


@dataclass(frozen=True)
class MatmulConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    block_m: int = MAX_ROWS
    # the dot taken as `W x^T`: the weight tile on the MMA's row side, the rows on its columns
    swap: bool = False


# any row count, one launch for every weight: rows never depend on the others (64-row tiles, so a
# long prefill reloads each weight M/64 times, not M/16)
INVARIANT_CONFIG = MatmulConfig(
    block_n=64, block_k=64, split_k=1, num_warps=4, num_stages=3, block_m=64
)


def matmul_config(n: int, k: int, fp8: bool = False) -> MatmulConfig:
    """The launch for `[<= 16, k] x [n, k]^T`: when the output has too few tiles of 32 columns to
    occupy the GPU (n < 4096), K in 8 slices of 128-column blocks (K of at least 8 blocks) or 4
    (at least 4), or 2 where 64 tiles or more meet 32 blocks or more (Qwen3-30B-A3B's o); else
    one slice per tile. Where K fits in at most 8 blocks of 256
    (1024 < K <= 2048), each slice is one such block, so that with PDL a program loads all its
    weights before it waits for its input. FP8 weights (`fp8`) wider than 4096 over K of at
    most 4096 take 64-column tiles of 256-column blocks, K unsplit; others of 128 to 511 tiles
    (of 32 columns) 64-column tiles with K in 4 slices of 256-column blocks: a tile of e4m3 is half
    the bytes. FP8 dots take the weight tile as the left operand (`swap`) but on the widest
    weights. Why these slice counts and
    stages: docs/tuning.md, "Split-K skinny matmul" and "FP8 GEMMs"; the PDL overlap:
    "Programmatic dependent launch"."""
    block_n, block_k = 32, 128
    tiles, k_blocks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    if fp8 and n > 4096 and k <= 4096:
        return MatmulConfig(64, 256, 1, num_warps=4, num_stages=5, swap=n < 16384)
    if fp8 and 128 <= tiles < 512:
        return MatmulConfig(64, 256, 4, num_warps=4, num_stages=3, swap=True)
    if tiles >= 128:
        return MatmulConfig(block_n, block_k, 1, num_warps=4, num_stages=6)
    if tiles >= 64 and k_blocks >= 32:  # 2 slices already give 128+ programs; 8 cost more
        return MatmulConfig(block_n, block_k, 2, num_warps=4, num_stages=6)
    if 8 < k_blocks <= 16:
        return MatmulConfig(block_n, 256, triton.cdiv(k, 256), num_warps=4, num_stages=3)
    split = 8 if k_blocks >= 8 else 4 if k_blocks >= 4 else 1
    return MatmulConfig(block_n, block_k, split, num_warps=4, num_stages=6)


def fp8_rows_config(n: int) -> MatmulConfig:
    """The FP8 launch for 17 to FP8_MAX_ROWS rows of an `[n, K]` weight: one 64-row tile, K
    unsplit, columns by the weight's width (docs/tuning.md, "FP8 GEMMs")."""
    if n >= 16384:
        return MatmulConfig(128, 128, 1, num_warps=8, num_stages=3, block_m=64)
    return MatmulConfig(64 if n > 4096 else 32, 256, 1, num_warps=4, num_stages=3, block_m=64)


@triton.jit
def weight_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """The rows of W a program's tile covers: `BLOCK_N` consecutive ones, or with `GATED` (W is
    `[gate; up]`, N = 2I) gate row c and up row I + c interleaved for `BLOCK_N // 2` columns c."""
    j = tl.arange(0, BLOCK_N)
    if GATED:
        return (j % 2) * (N // 2) + pid_n * (BLOCK_N // 2) + j // 2
    return pid_n * BLOCK_N + j


@triton.jit
def write_tile(
    Y,
    B,
    Scale,
    acc,
    offs_m,
    offs_n,
    pid_n,
    M,
    N,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    x_scale,
    FP8: tl.constexpr,
):
    """Store the tile `acc` (with `FP8` times W's row scales and x's, `x_scale` `[BLOCK_M]`, +
    bias) of W rows `offs_n`; with `GATED`, `silu(gate) * up` over its column pairs, rounded as
    SiluAndMul rounds the separate launch's bf16/fp16 input."""
    if FP8:
        acc *= tl.load(Scale + offs_n, mask=offs_n < N, other=0.0)[None, :]
        acc *= x_scale[:, None]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        g = gate.to(Y.dtype.element_ty).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        acc = silu * up.to(Y.dtype.element_ty).to(tl.float32)
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        N = N // 2
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(
        Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask
    )


@triton.jit
def weight_tile(W, offs_n, k_block, N, K, stride_wn, BLOCK_K: tl.constexpr):
    """Rows `offs_n` of W over the `k_block`-th BLOCK_K columns (zeros past N and K)."""
    offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(
        W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
        mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
        other=0.0,
    )


@triton.jit
def x_tile(X, offs_m, k_block, M, K, stride_xm, BLOCK_K: tl.constexpr):
    """Rows `offs_m` of X over the `k_block`-th BLOCK_K columns (zeros past M and K)."""
    offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(
        X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
        other=0.0,
    )


@triton.jit
def dot_tile(
    x,
    w,
    acc,
    x_scale,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    """`acc + x @ w^T` for an input tile `x` `[BLOCK_M, BLOCK_K]` (`SWAP`: its transpose,
    `acc + w @ x^T`); with `QUANTIZE` `x` is first quantized to e4m3 by its rows' scales
    `x_scale` `[BLOCK_M]` (w is e4m3)."""
    if QUANTIZE:
        x = scaled_e4m3(x.to(tl.float32), x_scale[:, None]).to(tl.float8e4nv)
    # one return after the branches: Triton compiles what follows a taken constexpr `if`
    if SWAP:
        if x.dtype == tl.float8e4nv:  # and so is w
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        if x.dtype == tl.float8e4nv:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _summed_tile(
    X,
    R,
    offs_m,
    k_block,
    M,
    K,
    stride_xm,
    stride_r,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """X's tile plus R's (`HAS_RESIDUAL`), rounded to X's dtype: the norm's input (and the new
    residual), as `rms_norm` sums them."""
    x = x_tile(X, offs_m, k_block, M, K, stride_xm, BLOCK_K)
    if HAS_RESIDUAL:
        r = x_tile(R, offs_m, k_block, M, K, stride_r, BLOCK_K)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    return x


@triton.jit
def _row_chunk(X, R, row, k0, K, stride_xm, stride_r, HAS_RESIDUAL: tl.constexpr):
    """`_ROW_CHUNK` columns of row `row` from `k0`: X's, plus R's with `HAS_RESIDUAL` rounded to
    X's dtype as `_summed_tile` rounds them, and where they lie."""
    cols = k0 + tl.arange(0, _ROW_CHUNK)
    x = tl.load(X + row * stride_xm + cols, mask=cols < K, other=0.0)  # row < 16: no overflow
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=cols < K, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    return x, cols


@triton.jit
def _norm_rstd(
    X,
    R,
    offs_m,
    M,
    K,
    stride_xm,
    stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """`rsqrt(mean(s^2) + eps)` `[BLOCK_M]` of the rows' sums s over all of K, a row at a time
    in wide chunks (few dependent loads before the first dot)."""
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    first = tl.min(offs_m, axis=0)
    for row in range(first, tl.minimum(M, first + BLOCK_M)):
        squares = tl.sum(tl.zeros((_ROW_CHUNK,), tl.float32), axis=0)
        for k0 in range(0, K, _ROW_CHUNK):
            s, _ = _row_chunk(X, R, row, k0, K, stride_xm, stride_r, HAS_RESIDUAL)
            s = s.to(tl.float32)
            squares += tl.sum(s * s, axis=0)
        rstd = tl.where(offs_m == row, tl.math.rsqrt(squares / K + eps), rstd)
    return rstd


@triton.jit
def input_tile(
    X,
    R,
    NormW,
    ResOut,
    rstd,
    offs_m,
    k_block,
    M,
    K,
    stride_xm,
    stride_r,
    write_residual,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The matmul's input tile: X's, or with `NORM` RMSNorm's output of X (+ R) as `rms_norm`
    computes it, `weight * (s * rstd)` in float32 not yet rounded (the sum s stored to ResOut
    where `write_residual`)."""
    if NORM:
        s = _summed_tile(X, R, offs_m, k_block, M, K, stride_xm, stride_r, HAS_RESIDUAL, BLOCK_K)
        offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
        if HAS_RESIDUAL:  # noqa: SIM102 (a constexpr, then a runtime flag: not one `and`)
            if write_residual:
                mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
                tl.store(ResOut + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], s, mask=mask)
        normed = (s.to(tl.float32) * rstd[:, None]).to(s.dtype).to(tl.float32)
        w = tl.load(NormW + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        x = w[None, :] * normed
    else:  # one return after the branches (see dot_tile)
        x = x_tile(X, offs_m, k_block, M, K, stride_xm, BLOCK_K)
    return x


@triton.jit
def row_scales(
    X,
    R,
    NormW,
    rstd,
    offs_m,
    M,
    K,
    stride_xm,
    stride_r,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The per-token e4m3 scales `[BLOCK_M]` of the input's rows `offs_m` over all of K (X's,
    or with `NORM` the norm's output by the rows' `rstd`: what `quantize_activation` and
    `rms_norm_quantize` give them), a row at a time in wide chunks."""
    scales = tl.zeros((BLOCK_M,), tl.float32)
    first = tl.min(offs_m, axis=0)
    for row in range(first, tl.minimum(M, first + BLOCK_M)):
        amax = tl.sum(tl.zeros((_ROW_CHUNK,), tl.float32), axis=0)
        for k0 in range(0, K, _ROW_CHUNK):
            x, cols = _row_chunk(X, R, row, k0, K, stride_xm, stride_r, HAS_RESIDUAL)
            y = x.to(tl.float32)
            if NORM:  # as input_tile normalizes it
                row_rstd = tl.sum(tl.where(offs_m == row, rstd, 0.0), axis=0)
                w = tl.load(NormW + cols, mask=cols < K, other=0.0).to(tl.float32)
                y = w * (y * row_rstd).to(x.dtype).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=0))
        scales = tl.where(offs_m == row, amax_scale(amax), scales)
    return scales


@triton.jit
def slice_product(
    X,
    W,
    XScale,
    R,
    NormW,
    ResOut,
    eps,
    stride_r,
    offs_m,
    offs_n,
    first,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    write_residual,
    BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    FP8: tl.constexpr,
    QUANTIZE_X: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """(`x[offs_m] @ W[offs_n]^T` over `BLOCKS` blocks of K from block `first`, a
    `[BLOCK_M, BLOCK_N]` float32 tile, and x's row scales `[BLOCK_M]`: `XScale`'s with `FP8`,
    found here with `QUANTIZE_X`, else unused). x is X, or with `NORM` the RMSNorm (weight
    `NormW`, `eps`) of X (+ R with `HAS_RESIDUAL`, the sum stored to ResOut where
    `write_residual`), each program finding its rows' rstd first. Waits for the producers of X
    first; with PDL the first weight tile loads before that (the weights are constant)."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if USE_PDL:
        w = weight_tile(W, offs_n, first, N, K, stride_wn, BLOCK_K)
    wait_for_producers(USE_PDL)
    if NORM:  # every program reads its rows whole for their rstd first
        rstd = _norm_rstd(X, R, offs_m, M, K, stride_xm, stride_r, eps, HAS_RESIDUAL, BLOCK_M)
    else:
        rstd = tl.zeros((BLOCK_M,), tl.float32)  # unused
    if QUANTIZE_X:  # the input quantized per token here: its rows' amax first
        x_scale = row_scales(
            X,
            R,
            NormW,
            rstd,
            offs_m,
            M,
            K,
            stride_xm,
            stride_r,
            NORM,
            HAS_RESIDUAL,
            BLOCK_M,
        )
    elif FP8:
        x_scale = tl.load(XScale + offs_m, mask=offs_m < M, other=0.0)
    else:
        x_scale = tl.zeros((BLOCK_M,), tl.float32)  # unused
    start = 0
    if USE_PDL:  # the prefetched tile first
        x = input_tile(
            X,
            R,
            NormW,
            ResOut,
            rstd,
            offs_m,
            first,
            M,
            K,
            stride_xm,
            stride_r,
            write_residual,
            NORM,
            HAS_RESIDUAL,
            BLOCK_K,
        )
        if not QUANTIZE_X:
            x = x.to(X.dtype.element_ty)  # the norm's output rounded as `rms_norm` rounds it
        acc = dot_tile(x, w, acc, x_scale, PRECISION, SWAP, QUANTIZE_X)
        start = 1
    for i in range(start, BLOCKS):
        w = weight_tile(W, offs_n, first + i, N, K, stride_wn, BLOCK_K)
        x = input_tile(
            X,
            R,
            NormW,
            ResOut,
            rstd,
            offs_m,
            first + i,
            M,
            K,
            stride_xm,
            stride_r,
            write_residual,
            NORM,
            HAS_RESIDUAL,
            BLOCK_K,
        )
        if not QUANTIZE_X:
            x = x.to(X.dtype.element_ty)
        acc = dot_tile(x, w, acc, x_scale, PRECISION, SWAP, QUANTIZE_X)
    if SWAP:
        acc = tl.trans(acc)
    return acc, x_scale


@triton.jit
def merge_slices(
    acc,
    Partials,
    Arrivals,
    pid_n,
    pid_k,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Hand slice `pid_k`'s partial tile `acc` of tile `pid_n` to the workspace: (whether this
    program arrived last on the tile's counter, and then the slices' sum in slice order, the
    counter back at zero; else zeros)."""
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    parts = Partials + pid_n * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(parts + pid_k * (BLOCK_M * BLOCK_N) + tile, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(Arrivals + pid_n, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if last:
        tl.store(Arrivals + pid_n, 0)
        for s in range(0, SPLIT_K):
            total += tl.load(parts + s * (BLOCK_M * BLOCK_N) + tile, cache_modifier=".cg")
    return last, total


# one variant for every row count: docs/tuning.md, "Few compiled variants"
@triton.jit(do_not_specialize=["M"])
def _skinny_matmul_kernel(
    X,
    W,
    B,
    Scale,
    XScale,
    Y,
    Partials,
    Arrivals,
    R,
    NormW,
    ResOut,
    eps,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_r,
    BLOCKS_PER_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,
    QUANTIZE_X: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SWAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = weight_rows(pid_n, N, BLOCK_N, GATED)
    acc, x_scale = slice_product(
        X,
        W,
        XScale,
        R,
        NormW,
        ResOut,
        eps,
        stride_r,
        offs_m,
        offs_n,
        pid_k * BLOCKS_PER_SPLIT,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        pid_n == 0,
        BLOCKS_PER_SPLIT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
        SWAP,
        FP8,
        QUANTIZE_X,
        NORM,
        HAS_RESIDUAL,
        USE_PDL,
    )
    if SPLIT_K == 1:
        write_tile(
            Y,
            B,
            Scale,
            acc,
            offs_m,
            offs_n,
            pid_n,
            M,
            N,
            stride_ym,
            HAS_BIAS,
            GATED,
            BLOCK_M,
            BLOCK_N,
            x_scale,
            FP8,
        )
    else:
        last, total = merge_slices(acc, Partials, Arrivals, pid_n, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:  # the last slice of this tile: write the sum
            write_tile(
                Y,
                B,
                Scale,
                total,
                offs_m,
                offs_n,
                pid_n,
                M,
                N,
                stride_ym,
                HAS_BIAS,
                GATED,
                BLOCK_M,
                BLOCK_N,
                x_scale,
                FP8,
            )


def _check_norm(x: torch.Tensor, norm: NormInput, x_scale: torch.Tensor | None) -> None:
    """ValueError for a norm prologue the kernel does not take."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > MAX_ROWS:
        raise ValueError(f"a norm prologue takes at most {MAX_ROWS} rows, not {rows}")
    if x_scale is not None:
        raise ValueError("a norm prologue takes x unquantized")
    if norm.weight.shape != (x.shape[-1],) or norm.weight.dtype != x.dtype:
        raise ValueError(f"the norm's weight must be [{x.shape[-1]}] {x.dtype}")
    if (norm.residual is None) != (norm.residual_out is None):
        raise ValueError("a residual and its residual_out go together")
    for name, t in (("residual", norm.residual), ("residual_out", norm.residual_out)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(f"{name} must be {x.dtype} {list(x.shape)}")
    if norm.residual_out is not None and not norm.residual_out.is_contiguous():
        raise ValueError("residual_out must be contiguous")


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def split_k_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials, int32 arrival counters, all zero) of `device`, allocated on first use
    (`reserve_workspace` makes that happen before any CUDA-graph capture). The MoE pair kernels
    share it: each kernel touches it only after its producers have finished, and leaves every
    counter at zero."""
    if device not in _workspaces:
        partials = torch.empty(_PARTIAL_FLOATS, dtype=torch.float32, device=device)
        _workspaces[device] = (
            partials,
            torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device),
        )
    return _workspaces[device]


def reserve_workspace(device: torch.device) -> None:
    """Allocate `device`'s split-K workspace now, so that no first call allocates it inside a
    CUDA-graph capture (into a graph's private pool)."""
    split_k_workspace(device)


def skinny_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    gated_silu: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    norm: NormInput | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x` `[..., K]` (unit column stride; any row stride), `weight`
    `[N, K]` contiguous; FP8: `weight` e4m3 with `weight_scale` (float32 `[N]`: the weight is
    `weight * weight_scale`), `out_dtype` then required, and `x` e4m3 with `x_scale` (float32,
    one per row) or in a float dtype, quantized per token inside the kernel (each program reads
    its rows whole for their scales first: the numbers of `quantize_activation` then this);
    a new `[..., N]` tensor in `out_dtype` (default x's: the float32 sums are rounded to it once,
    e.g. float32 logits unrounded). `config` overrides `matmul_config(N, K, fp8)`; a split-K config
    takes at most its `block_m` (<= 16) rows. `gated_silu`: `weight` is `[gate; up]` (N even)
    and the result `[..., N / 2]` is SiluAndMul of the product, bit-equal to
    `silu_and_mul(skinny_matmul(...))` in one launch (x's dtype; FP8: `out_dtype`). `out`: a
    contiguous tensor of the result's shape and dtype to write (and return) instead of a new one
    (e.g. a buffer that outlives a CUDA graph's private pool). `norm`: the matmul of
    `rms_norm(x (+ residual))` instead, at most MAX_ROWS rows of one dtype, each program
    normalizing its rows itself (the new residual written by the programs of the first column
    tile); an FP8 weight then quantizes the norm's output in the kernel as `rms_norm_quantize`
    does."""
    n, k = weight.shape
    fp8 = weight_scale is not None
    if norm is not None:
        _check_norm(x, norm, x_scale)
    if (x_scale is not None and not fp8) or (fp8 and out_dtype is None):
        raise ValueError("FP8 takes weight_scale and out_dtype together (and an e4m3 x's x_scale)")
    if fp8 and x_scale is None and x.dtype == torch.float8_e4m3fn:
        raise ValueError("an e4m3 x comes with its x_scale")
    out_dtype = out_dtype or x.dtype
    x2 = as_rows(x, k)
    m = x2.shape[0]
    if x_scale is not None and x_scale.numel() != m:
        raise ValueError(f"x_scale holds one scale per row: {m}, not {x_scale.numel()}")
    if config is not None:
        cfg = config
    elif fp8 and m > MAX_ROWS:
        cfg = fp8_rows_config(n)
    else:
        cfg = matmul_config(n, k, fp8=fp8)
    if cfg.split_k > 1 and m > min(cfg.block_m, MAX_ROWS):
        raise ValueError(f"split-K takes at most {min(cfg.block_m, MAX_ROWS)} rows, got {m}")
    if weight.stride(1) != 1 or weight.stride(0) != k:
        raise ValueError("the weight must be contiguous [N, K]")
    if gated_silu and n % 2:
        raise ValueError(f"a gated weight has an even number of rows, not {n}")
    if gated_silu and not fp8 and out_dtype != x.dtype:
        raise ValueError(f"a gated launch writes x's dtype {x.dtype}, not {out_dtype}")
    width = n // 2 if gated_silu else n
    shape = (*x.shape[:-1], width)
    if out is not None and (
        out.shape != shape or out.dtype != out_dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {out_dtype} tensor of shape {list(shape)}, "
            f"not {out.dtype} {list(out.shape)}"
        )
    y = out if out is not None else torch.empty(shape, dtype=out_dtype, device=x.device)
    tiles = triton.cdiv(width, cfg.block_n // 2) if gated_silu else triton.cdiv(n, cfg.block_n)
    if cfg.split_k > 1 and (
        tiles > _MAX_SPLIT_TILES
        or tiles * cfg.split_k * cfg.block_m * cfg.block_n > _PARTIAL_FLOATS
    ):
        raise ValueError(f"split-K launch {cfg} over {tiles} tiles exceeds the workspace")
    partials, arrivals = split_k_workspace(x.device) if cfg.split_k > 1 else (y, y)  # y: unused
    residual = None if norm is None or norm.residual is None else as_rows(norm.residual, k)
    if m:
        _skinny_matmul_kernel[(tiles, cfg.split_k, triton.cdiv(m, cfg.block_m))](
            x2,
            weight,
            weight if bias is None else bias,
            weight if weight_scale is None else weight_scale,
            weight if x_scale is None else x_scale,
            y,
            partials,
            arrivals,
            x2 if residual is None else residual,
            weight if norm is None else norm.weight,
            x2 if norm is None or norm.residual_out is None else norm.residual_out,
            0.0 if norm is None else norm.eps,
            m,
            n,
            k,
            x2.stride(0),
            weight.stride(0),
            width,
            0 if residual is None else residual.stride(0),
            BLOCKS_PER_SPLIT=triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k),
            HAS_BIAS=bias is not None,
            SPLIT_K=cfg.split_k,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            PRECISION=dot_precision(x.dtype),
            GATED=gated_silu,
            FP8=fp8,
            QUANTIZE_X=fp8 and x_scale is None,
            NORM=norm is not None,
            HAS_RESIDUAL=residual is not None,
            SWAP=cfg.swap,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **pdl_launch(),
        )
    return y
