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
scales on the float32 sums at the end (docs/tuning.md, "FP8 GEMMs").

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
from typing import Any

import torch
import triton
import triton.language as tl

from replaylm.layers.attention.triton.common import dot_precision
from replaylm.layers.kernels import as_rows, pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.kernels.silu_mul import silu_mul_rounded

MAX_ROWS = 16  # the row tile: one program covers every row of a decode batch up to this
# FP8 rows the kernel takes: up to here it reads the weight once, faster than cuBLASLt's FP8 GEMM
FP8_MAX_ROWS = 64
# the workspace's bounds: fp32 partials of a split-K launch (output tiles, of every row tile, x
# slices x BLOCK_M x BLOCK_N; 8 MiB) and output tiles (one arrival counter each)
_PARTIAL_FLOATS, _MAX_SPLIT_TILES = 2**21, 4096


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

    def launch(self) -> dict[str, Any]:
        """The keywords of a launch of this tile (`slice_product`'s kernels): its constexprs,
        warps and stages, and PDL's."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "SWAP": self.swap,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **pdl_launch(),
        }


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
    XScale,
    FP8: tl.constexpr,
):
    """Store the tile `acc` (with `FP8` times W's and x's row scales, + bias) of W rows `offs_n`;
    with `GATED`, `silu(gate) * up` over its column pairs, rounded as SiluAndMul rounds the
    separate launch's bf16/fp16 input."""
    if FP8:
        acc *= tl.load(Scale + offs_n, mask=offs_n < N, other=0.0)[None, :]
        acc *= tl.load(XScale + offs_m, mask=offs_m < M, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        acc = silu_mul_rounded(gate, up, Y.dtype.element_ty)
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
def dot_tile(
    X,
    w,
    acc,
    offs_m,
    k_block,
    M,
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
):
    """`acc + X[offs_m, k_block-th BLOCK_K columns] @ w^T` (`SWAP`: its transpose,
    `acc + w @ X[...]^T`)."""
    offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(
        X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
        other=0.0,
    )
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
def slice_product(
    X,
    W,
    offs_m,
    offs_n,
    first,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`X[offs_m] @ W[offs_n]^T` over `BLOCKS` blocks of K from block `first`, a
    `[BLOCK_M, BLOCK_N]` float32 tile (FP8: before the scales). Waits for the producers of X
    first; with PDL the first weight tile loads before that (the weights are constant)."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if USE_PDL:
        w = weight_tile(W, offs_n, first, N, K, stride_wn, BLOCK_K)
    wait_for_producers(USE_PDL)
    if USE_PDL:  # the prefetched tile first
        acc = dot_tile(X, w, acc, offs_m, first, M, K, stride_xm, BLOCK_K, PRECISION, SWAP)
    start = 1 if USE_PDL else 0  # folded: the loop's bounds stay constants
    for i in range(start, BLOCKS):
        w = weight_tile(W, offs_n, first + i, N, K, stride_wn, BLOCK_K)
        acc = dot_tile(X, w, acc, offs_m, first + i, M, K, stride_xm, BLOCK_K, PRECISION, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    return acc


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
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCKS_PER_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,
    SWAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = weight_rows(pid_n, N, BLOCK_N, GATED)
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
    last = True  # one slice writes its tile; of several, the last to arrive writes the sum
    if SPLIT_K > 1:
        tile = pid_m * tl.num_programs(0) + pid_n  # every row tile's output tiles apart
        last, acc = merge_slices(acc, Partials, Arrivals, tile, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)
    if last:
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
            XScale,
            FP8,
        )


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
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x` `[..., K]` (unit column stride; any row stride), `weight`
    `[N, K]` contiguous; FP8: `weight` e4m3 with `weight_scale` (float32 `[N]`: the weight is
    `weight * weight_scale`) and `x` e4m3 with `x_scale` (float32, one per row), given together,
    and `out_dtype` then required;
    a new `[..., N]` tensor in `out_dtype` (default x's: the float32 sums are rounded to it once,
    e.g. float32 logits unrounded). `config` overrides `matmul_config(N, K, fp8)` (a split-K launch
    over as many row tiles as the workspace holds). `gated_silu`: `weight` is `[gate; up]` (N even)
    and the result `[..., N / 2]` is SiluAndMul of the product, bit-equal to
    `silu_and_mul(skinny_matmul(...))` in one launch (x's dtype; FP8: `out_dtype`). `out`: a
    contiguous tensor of the result's shape and dtype to write (and return) instead of a new one
    (e.g. a buffer that outlives a CUDA graph's private pool)."""
    n, k = weight.shape
    fp8 = weight_scale is not None
    if fp8 != (x_scale is not None) or (fp8 and out_dtype is None):
        raise ValueError("FP8 takes weight_scale, x_scale and out_dtype together")
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
    row_tiles = triton.cdiv(m, cfg.block_m)
    if cfg.split_k > 1 and (
        tiles * row_tiles > _MAX_SPLIT_TILES
        or tiles * row_tiles * cfg.split_k * cfg.block_m * cfg.block_n > _PARTIAL_FLOATS
    ):
        raise ValueError(
            f"split-K launch {cfg} over {tiles} x {row_tiles} tiles exceeds the workspace"
        )
    partials, arrivals = split_k_workspace(x.device) if cfg.split_k > 1 else (y, y)  # y: unused
    if m:
        _skinny_matmul_kernel[(tiles, cfg.split_k, row_tiles)](
            x2,
            weight,
            weight if bias is None else bias,
            weight if weight_scale is None else weight_scale,
            weight if x_scale is None else x_scale,
            y,
            partials,
            arrivals,
            m,
            n,
            k,
            x2.stride(0),
            weight.stride(0),
            width,
            BLOCKS_PER_SPLIT=triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k),
            HAS_BIAS=bias is not None,
            SPLIT_K=cfg.split_k,
            PRECISION=dot_precision(x.dtype),
            GATED=gated_silu,
            FP8=fp8,
            **cfg.launch(),
        )
    return y
