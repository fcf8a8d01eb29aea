"""The FP8 matmul's Triton kernels: activation quantization (alone, or fused into the RMSNorm or
the SiluAndMul that makes the activation) and the block-scaled GEMM.

`quantize_activation` is `fp8.quantize_activation` in one launch: each program takes one token's
group of columns (per token: the whole row as one group), its amax over 448 as the scale (the
least amax MIN_AMAX), the values divided by it and saturated to +-448, then rounded to e4m3; or
it takes the layer's static scale (the largest of its input scales, read in the kernel). The
same numbers bit for bit: correctly rounded divisions (the torch code's on the CPU; CUDA's torch
multiplies by 1/448 instead) and round-to-nearest-even onto e4m3's grid done in float32 (Triton's
interpreter rounds the float32 -> e4m3 cast wrongly), so the cast itself is exact.

`block_fp8_matmul` is the GEMM of 128x128 block-scaled checkpoints (DeepSeek-V3, Qwen3-*-FP8):
`y[m, n] = sum over k blocks b of (x_q[m, b] . w_q[n, b]) * x_scale[m, b] * w_scale[n // bn, b]`.
BLOCK_K is the weight's block k, so each step of the K loop has one activation scale per row and
one weight scale per column; the dot of a step is taken on the tensor cores in FP8, scaled and
added to a float32 accumulator, which is rounded once to the output dtype. Ragged last blocks of
N and K are masked. The launch depends on the row count and N (`block_gemm_config`).

Both allocate their outputs and never sync with the host: CUDA graphs capture them. Under
torch.compile the quantize-and-GEMM pair is the custom op `replaylm::fp8_block_linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import as_rows, pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.kernels.rmsnorm import norm_rows, row_rstd, summed_rows, weighted_norm
from replaylm.layers.kernels.silu_mul import silu_mul_columns
from replaylm.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, Block, QuantizedRows

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)
# float32 exponent fields: e4m3's least normal binade (2^-6; below it the spacing stays 2^-9),
# and how far above a binade a float32's spacing is e4m3's in it (23 - 3 mantissa bits)
_MIN_NORMAL_FIELD = tl.constexpr(121 << 23)
_SPACING_SHIFT = tl.constexpr(20 << 23)
# decode: column tiles as wide as still give the GPU this many programs
_MIN_TILES = 128
# per-token quantization of at most this many rows (decode) takes a program a piece of this many
# columns of a wider row
SPLIT_ROWS, SPLIT_PIECE = 16, 1024
# SiluAndMul's quantization holds at most this many columns of a row at once
SILU_QUANT_CHUNK = 16384


@triton.jit
def _round_to_e4m3(y):
    """`y` (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, still float32:
    adding and subtracting 2^(e + 20), whose float32 spacing is e4m3's in y's binade 2^e,
    rounds at that spacing. The sign is put back by its bit (-0 stays -0)."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    binade = tl.maximum(magnitude & 0x7F800000, _MIN_NORMAL_FIELD)
    magic = (binade + _SPACING_SHIFT).to(tl.float32, bitcast=True)
    rounded = (magnitude.to(tl.float32, bitcast=True) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits ^ magnitude)).to(tl.float32, bitcast=True)


@triton.jit
def _amax_scale(amax):
    """The scale of values whose largest magnitude is `amax`: amax over 448, the amax at least
    MIN_AMAX, correctly rounded."""
    return tl.math.div_rn(tl.maximum(amax, _MIN_AMAX), _FP8_MAX)


@triton.jit
def _token_scale(x):
    """The per-token (or per-group) scale of `x` (float32, any shape: one token's values)."""
    return _amax_scale(tl.max(tl.abs(x)))


@triton.jit
def _scaled_e4m3(x, scale):
    """`x / scale` saturated to +-448 and rounded onto e4m3's grid (still float32)."""
    return _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX))


def _quantized_buffers(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Empty e4m3 values `[rows, width]` and float32 per-token scales `[rows, 1]`."""
    q = torch.empty((rows, width), dtype=FP8_DTYPE, device=device)
    return q, torch.empty((rows, 1), dtype=torch.float32, device=device)


@triton.jit
def _quantize_kernel(
    X,
    Q,
    Scale,
    Static,
    n_cols,
    group,
    num_static,
    stride_x,
    BLOCK: tl.constexpr,
    STATIC_BLOCK: tl.constexpr,
    HAS_STATIC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Token `program_id(0)`'s `program_id(1)`-th group of `group` columns to e4m3 in Q, and its
    scale to Scale `[T, groups]`: the group's amax / 448, or the largest of `Static`'s scales."""
    wait_for_producers(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = g * group + offs
    mask = (offs < group) & (cols < n_cols)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_STATIC:
        which = tl.arange(0, STATIC_BLOCK)
        scales = tl.load(Static + which, mask=which < num_static, other=float("-inf"))
        scale = tl.max(scales.to(tl.float32), axis=0)
    else:
        scale = _token_scale(x)
    tl.store(Q + row * n_cols + cols, _scaled_e4m3(x, scale).to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + row * tl.num_programs(1) + g, scale)


@triton.jit
def _split_quantize_kernel(
    X, Q, Scale, n_cols, stride_x, BLOCK: tl.constexpr, PIECE: tl.constexpr, USE_PDL: tl.constexpr
):
    """Token `program_id(0)`'s `program_id(1)`-th piece of PIECE columns to e4m3 in Q, by the
    whole row's scale (the row read at once, BLOCK columns, for its amax: every piece's program
    finds the same one, and the first stores it to Scale `[T, 1]`): `_quantize_kernel`'s numbers
    per token, its divisions spread over the pieces' programs."""
    wait_for_producers(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    whole = tl.load(X + row * stride_x + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    scale = _token_scale(whole)
    cols = piece * PIECE + tl.arange(0, PIECE)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Q + row * n_cols + cols, _scaled_e4m3(x, scale).to(Q.dtype.element_ty), mask=mask)
    if piece == 0:
        tl.store(Scale + row, scale)


def _takes_pieces(rows: int, width: int) -> bool:
    """Whether a per-token quantization of `rows` x `width` takes a program a SPLIT_PIECE piece
    of a row: decode rows (at most SPLIT_ROWS) wider than a piece, where one program's
    correctly rounded divisions over a whole row would be the launch's time."""
    return rows <= SPLIT_ROWS and width > SPLIT_PIECE


def quantize_activation(
    x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_activation`'s contract and numbers in one launch: `x` `[T, K]` (bf16, fp16
    or fp32, unit column stride) as (e4m3 `[T, K]`, contiguous float32 scales `[T, ceil(K /
    group)]`, or `[T, 1]` per token or with `static_scale`, whose largest element is taken).
    Up to SPLIT_ROWS tokens per token, rows wider than SPLIT_PIECE take a program a piece of
    SPLIT_PIECE columns (`_split_quantize_kernel`): one program's divisions over a whole row
    are the launch's time at decode rows."""
    tokens, width = x.shape
    x2 = as_rows(x, width)
    if static_scale is None and group is None and _takes_pieces(tokens, width):
        q, scale = _quantized_buffers(tokens, width, x.device)
        if tokens:
            _split_quantize_kernel[(tokens, triton.cdiv(width, SPLIT_PIECE))](
                x2,
                q,
                scale,
                width,
                x2.stride(0),
                BLOCK=triton.next_power_of_2(width),
                PIECE=SPLIT_PIECE,
                num_warps=8,
                **pdl_launch(),
            )
        return q, scale
    if static_scale is not None or group is None:
        group = width
    groups = triton.cdiv(width, group)
    q = torch.empty((tokens, width), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((tokens, groups), dtype=torch.float32, device=x.device)
    # without a static scale the kernel reads none: any pointer does
    static = scale if static_scale is None else static_scale.reshape(-1)
    num_static = 0 if static_scale is None else static.numel()
    block = triton.next_power_of_2(group)
    if tokens:
        _quantize_kernel[(tokens, groups)](
            x2,
            q,
            scale,
            static,
            width,
            group,
            num_static,
            x2.stride(0),
            BLOCK=block,
            STATIC_BLOCK=triton.next_power_of_2(max(num_static, 1)),
            HAS_STATIC=static_scale is not None,
            num_warps=min(max(block // 256, 1), 8),
            **pdl_launch(),
        )
    return q, scale


@triton.jit(do_not_specialize=["n_rows"])  # one variant for every row count
def _rms_norm_quantize_kernel(
    X,
    R,
    W,
    Q,
    Scale,
    ResOut,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    eps,
    ExpertWeights,
    ExpertIds,
    num_experts,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOP_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Row `program_id(0)`'s RMSNorm (`norm_rows`, with `TOP_K` of a weighted sum of X's expert
    rows), rounded to X's dtype as the norm's output is, then quantized per token as
    `_quantize_kernel` quantizes it: e4m3 to Q, scale to Scale."""
    wait_for_producers(USE_PDL)
    y, rows, cols, mask = norm_rows(
        X,
        R,
        W,
        ResOut,
        n_rows,
        n_cols,
        stride_x,
        stride_r,
        eps,
        HAS_RESIDUAL,
        1,
        BLOCK_D,
        ExpertWeights,
        ExpertIds,
        num_experts,
        TOP_K,
    )
    y = y.to(X.dtype.element_ty).to(tl.float32)
    scale = _token_scale(y)
    tl.store(Q + rows * n_cols + cols, _scaled_e4m3(y, scale).to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + rows, scale)


@triton.jit
def _split_rms_norm_quantize_kernel(
    X,
    R,
    W,
    Q,
    Scale,
    ResOut,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    eps,
    ExpertWeights,
    ExpertIds,
    num_experts,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PIECE: tl.constexpr,
    TOP_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`_rms_norm_quantize_kernel`'s numbers for row `program_id(0)`'s `program_id(1)`-th piece
    of PIECE columns: the whole row read for its rstd and amax (every piece's program finds the
    same), then the piece's columns read again, normalized, quantized and stored (with its new
    residual), so that a row's divisions spread over its pieces' programs."""
    wait_for_producers(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) + tl.zeros((1, 1), tl.int64)
    piece = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)[None, :]
    x = summed_rows(
        X,
        R,
        ResOut,
        rows,
        cols,
        cols < n_cols,
        n_rows,
        n_cols,
        stride_x,
        stride_r,
        HAS_RESIDUAL,
        False,
        ExpertWeights,
        ExpertIds,
        num_experts,
        TOP_K,
    )
    rstd = row_rstd(x, n_cols, eps)
    y = weighted_norm(x, rstd, W, cols, n_cols).to(X.dtype.element_ty).to(tl.float32)
    scale = _token_scale(y)
    cols = piece * PIECE + tl.arange(0, PIECE)[None, :]
    mask = cols < n_cols
    x = summed_rows(
        X,
        R,
        ResOut,
        rows,
        cols,
        mask,
        n_rows,
        n_cols,
        stride_x,
        stride_r,
        HAS_RESIDUAL,
        HAS_RESIDUAL,
        ExpertWeights,
        ExpertIds,
        num_experts,
        TOP_K,
    )
    y = weighted_norm(x, rstd, W, cols, n_cols).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Q + rows * n_cols + cols, _scaled_e4m3(y, scale).to(Q.dtype.element_ty), mask=mask)
    if piece == 0:
        tl.store(Scale + rows, scale)


def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    experts: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[QuantizedRows, torch.Tensor | None]:
    """`rmsnorm.rms_norm` (its numbers; with `residual`, the sum is the new residual) with the
    output quantized per token as `quantize_activation` quantizes it, in one launch: (the
    output's `[T, K]` QuantizedRows, the new residual or None). `x`, `weight` and `residual` of
    one dtype. `experts` (weights `[T, top_k]` float32, ids `[T, top_k]`, the expert count):
    `x` is a mixture of experts' rows `[T * top_k, K]`, summed first as
    `rmsnorm.rms_norm_of_expert_sum` sums them. Up to SPLIT_ROWS rows wider than SPLIT_PIECE
    take a program a piece, as `quantize_activation`'s do."""
    width = x.shape[-1]
    x2 = as_rows(x, width)
    n_rows = x2.shape[0] if experts is None else experts[1].shape[0]
    q, scale = _quantized_buffers(n_rows, width, x.device)
    # the new residual, shaped as the one it replaces
    res_out = None if residual is None else residual.new_empty(residual.shape, dtype=x.dtype)
    r2 = x2 if residual is None else as_rows(residual, width)
    block_d = triton.next_power_of_2(width)
    expert_weights, expert_ids, num_experts = experts or (x2, x2, 0)
    split = _takes_pieces(n_rows, width)
    kernel = _split_rms_norm_quantize_kernel if split else _rms_norm_quantize_kernel
    pieces = {"PIECE": SPLIT_PIECE} if split else {}
    if n_rows:
        kernel[(n_rows, triton.cdiv(width, SPLIT_PIECE) if split else 1)](
            x2,
            r2,
            weight,
            q,
            scale,
            q if res_out is None else res_out,  # without a residual: never written
            n_rows,
            width,
            x2.stride(0),
            r2.stride(0),
            eps,
            expert_weights,
            expert_ids,
            num_experts,
            HAS_RESIDUAL=residual is not None,
            BLOCK_D=block_d,
            TOP_K=0 if experts is None else expert_ids.shape[1],
            num_warps=min(max(block_d // 256, 1), 8),
            **pieces,
            **pdl_launch(),
        )
    return QuantizedRows(q, scale, x.dtype), res_out


@triton.jit
def _silu_mul_quantize_kernel(
    X, Q, Scale, width, stride_x, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr
):
    """Row `program_id(0)`'s SiluAndMul (`silu_mul_columns`) quantized per token as
    `_quantize_kernel` quantizes it: e4m3 to Q, scale to Scale. One chunk: the row is held
    whole; more: `CHUNKS` chunks of `CHUNK` columns, once for the amax and again (recomputed
    from the input, by then in L2) to quantize, so that a program holds one chunk at a time."""
    wait_for_producers(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    if CHUNKS == 1:
        mask = offs < width
        y = silu_mul_columns(X, row, offs, mask, width, stride_x).to(tl.float32)
        scale = _token_scale(y)
        tl.store(Q + row * width + offs, _scaled_e4m3(y, scale).to(Q.dtype.element_ty), mask=mask)
    else:
        amax = tl.max(tl.zeros((CHUNK,), tl.float32), axis=0)
        for c in range(CHUNKS):
            cols = c * CHUNK + offs
            y = silu_mul_columns(X, row, cols, cols < width, width, stride_x).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=0))
        scale = _amax_scale(amax)
        for c in range(CHUNKS):
            cols = c * CHUNK + offs
            mask = cols < width
            y = silu_mul_columns(X, row, cols, mask, width, stride_x).to(tl.float32)
            q = _scaled_e4m3(y, scale).to(Q.dtype.element_ty)
            tl.store(Q + row * width + cols, q, mask=mask)
    tl.store(Scale + row, scale)


def silu_and_mul_quantize(x: torch.Tensor, chunk: int | None = None) -> QuantizedRows:
    """`silu_mul.silu_and_mul` of `x` `[T, 2I]` (its numbers) quantized per token as
    `quantize_activation` quantizes it, in one launch: the `[T, I]` QuantizedRows. `chunk` (a
    power of two; default `SILU_QUANT_CHUNK`): a program's columns at a time, the row read twice
    where it is wider (a whole row held at once keeps few programs on an SM)."""
    width = x.shape[-1] // 2
    x2 = as_rows(x, 2 * width)
    rows = x2.shape[0]
    q, scale = _quantized_buffers(rows, width, x.device)
    block = min(triton.next_power_of_2(width), chunk or SILU_QUANT_CHUNK)
    if rows:
        _silu_mul_quantize_kernel[(rows,)](
            x2,
            q,
            scale,
            width,
            x2.stride(0),
            CHUNK=block,
            CHUNKS=triton.cdiv(width, block),
            # wide chunks (an 8B model's whole row of 14,336) want 16 warps to stream
            num_warps=min(max(block // 1024, 4), 16),
            **pdl_launch(),
        )
    return QuantizedRows(q, scale, x.dtype)


@dataclass(frozen=True)
class BlockGemmConfig:
    """A launch of the block-scaled GEMM (BLOCK_K is the weight's block k)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def block_gemm_config(m: int, n: int) -> BlockGemmConfig:
    """The launch for `[m, K] x [n, K]^T`: a row tile of 16 or 32 rows for decode batches, 64 up
    to 256 rows, 128 beyond; column tiles of 128 where that still makes _MIN_TILES programs,
    else 64, else 32 (a memory-bound GEMM streams its weight through as many programs as the
    GPU runs at once)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 256 else 128
    tiles_m = triton.cdiv(m, block_m)
    block_n = next((b for b in (128, 64) if tiles_m * triton.cdiv(n, b) >= _MIN_TILES), 32)
    big = block_m * block_n >= 128 * 128
    return BlockGemmConfig(
        block_m, block_n, num_warps=8 if big else 4, num_stages=3 if block_m == 128 else 4
    )


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid`: `GROUP_M` row tiles per group, down the rows
    first, so that consecutive programs read the same weight tile (from L2)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


# one variant for every row count: the token-dependent argument is not specialized
@triton.jit(do_not_specialize=["M"])
def _block_fp8_matmul_kernel(
    X,
    W,
    XScale,
    WScale,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_xsm,
    stride_wsn,
    stride_ym,
    WEIGHT_BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One `[BLOCK_M, BLOCK_N]` tile of Y: per K block, the FP8 dot times its rows' and
    columns' scales, summed in float32; rows and columns past M and N masked."""
    wait_for_producers(USE_PDL)
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = X + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = W + cols.to(tl.int64)[None, :] * stride_wn
    x_scales = XScale + rows.to(tl.int64) * stride_xsm
    w_scales = WScale + (cols // WEIGHT_BLOCK_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for b in range(0, tl.cdiv(K, BLOCK_K)):
        ks = b * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        x_scale = tl.load(x_scales + b, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scales + b, mask=col_ok, other=0.0)
        acc += tl.dot(x, w) * (x_scale[:, None] * w_scale[None, :])
    y = Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_operands(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Block,
) -> None:
    """ValueError for operands the GEMM does not take."""
    (m, k), (n, width) = x_q.shape, weight.shape
    block_n, block_k = block_size
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"the weight's block k must be a power of two >= 16, not {block_k}")
    if x_q.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"x_q and the weight must be {FP8_DTYPE}, not {x_q.dtype}/{weight.dtype}")
    if width != k:
        raise ValueError(f"x_q {list(x_q.shape)} does not fit the weight {list(weight.shape)}")
    shapes = {
        "x_scale": (x_scale, (m, triton.cdiv(k, block_k))),
        "weight_scale": (weight_scale, (triton.cdiv(n, block_n), triton.cdiv(k, block_k))),
    }
    for name, (scale, shape) in shapes.items():
        if tuple(scale.shape) != shape or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {list(shape)}, not {list(scale.shape)}")
    if any(t.stride(1) != 1 for t in (x_q, weight, x_scale, weight_scale)):
        raise ValueError("the operands and scales must have unit column stride")


def block_fp8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Block,
    out_dtype: torch.dtype,
    config: BlockGemmConfig | None = None,
) -> torch.Tensor:
    """`y` `[M, N]` in `out_dtype` of e4m3 `x_q` `[M, K]` with scales `x_scale` `[M, ceil(K /
    bk)]` (per token and bk-column group) and the e4m3 weight `[N, K]` with block scales
    `weight_scale` `[ceil(N / bn), ceil(K / bk)]`, `block_size` (bn, bk). `config` overrides
    `block_gemm_config`'s launch."""
    _check_operands(x_q, x_scale, weight, weight_scale, block_size)
    (m, k), n = x_q.shape, weight.shape[0]
    cfg = config or block_gemm_config(m, n)
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m:
        _block_fp8_matmul_kernel[(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)](
            x_q,
            weight,
            x_scale,
            weight_scale,
            y,
            m,
            n,
            k,
            x_q.stride(0),
            weight.stride(0),
            x_scale.stride(0),
            weight_scale.stride(0),
            y.stride(0),
            WEIGHT_BLOCK_N=block_size[0],
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=block_size[1],
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **pdl_launch(),
        )
    return y


def _block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Block,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`x` `[T, K]` quantized per token and block-k group, times the block-scaled weight."""
    x_q, x_scale = quantize_activation(x, block_size[1])
    return block_fp8_matmul(x_q, x_scale, weight, weight_scale, block_size, out_dtype)


@torch.library.custom_op("replaylm::fp8_block_linear", mutates_args=())
def _fp8_block_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _block_fp8_linear(x, weight, weight_scale, (block_n, block_k), out_dtype)


@_fp8_block_linear_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Block,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`x` `[T, K]` times the e4m3 weight `[N, K]` of block scales `weight_scale`, in
    `out_dtype`: the two kernels, called directly when run eagerly, as the custom op
    `replaylm::fp8_block_linear` when torch.compile traces them."""
    if not torch.compiler.is_compiling():
        return _block_fp8_linear(x, weight, weight_scale, block_size, out_dtype)
    return torch.ops.replaylm.fp8_block_linear(x, weight, weight_scale, *block_size, out_dtype)
