"""The experts' computation in fused Triton kernels (the GPU's route of `fused_experts`).

The routed (token, slot) pairs are sorted by expert into blocks of `block_m` rows
(`moe_align`); a grouped GEMM gives each program one block of one expert, its A rows gathered
from the pairs' tokens. It runs twice: gate_up with SiluAndMul in its epilogue (a tile covers
gate and up rows of the same columns), then down; a last kernel sums each token's k
rows weighted by the router in float32, skipping other ranks' experts. Four launches (six for
more than a decode step's pairs), no host sync, buffers sized by T, k, E and the block config
alone: CUDA graphs capture it. A batch of up to `PAIR_TOKENS` tokens of non-FP8 experts skips
the sort and the sum (`pair_experts.py`: two launches). Unquantized weights' tiles come by TMA
through a tensor descriptor where the GPU has it (`tma_weights`: docs/tuning.md, "MoE weights by
TMA"). Under torch.compile (inside `kernels_in_compiled_code`) it is the custom op
`replaylm::fused_experts`.

FP8 (e4m3) experts run w8a8, as vLLM's and SGLang's `use_fp8_w8a8`: each GEMM's A is quantized
to e4m3 first (`quantize_activation`: per token, per token and block-column group for block
scales, or the layers' static scale), the MMA takes e4m3 tiles into float32, and the scales
multiply the accumulator: per channel once in the epilogue (A's row times the weight's column),
per block at each K step (A's row and K group times the weight's block), BLOCK_K dividing the
block's columns so that a step lies in one group. The intermediate is quantized again for down.

Same numbers as `torch_experts` up to summation order: fp32 accumulation, each product rounded to
the input dtype (SiluAndMul rounded as the torch code rounds it), the weighted sum in float32.
FP8 takes the same quantized inputs, but where the two orders round the intermediate apart its
requantization can land on the neighbouring e4m3 value.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from replaylm.layers.attention.triton.common import dot_precision
from replaylm.layers.kernels import as_rows, pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.kernels.silu_mul import silu_mul_rounded
from replaylm.layers.moe.block_configs import (
    MoeBlockConfig,
    config_tokens,
    device_name,
    fits_block,
    moe_block_config,
)
from replaylm.layers.moe.moe_align import moe_align_block_size
from replaylm.layers.moe.pair_experts import PAIR_TOKENS, pair_experts
from replaylm.layers.moe.routed_rows import RoutedRows
from replaylm.layers.moe.torch_experts import Fp8ExpertScales
from replaylm.layers.moe.weighted_sum import weighted_sum
from replaylm.layers.quantization.fp8 import FP8_DTYPE, Block, quantize_activation
from replaylm.layers.quantization.layout import scale_shape


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
    """Store `acc` to the pairs' rows `slots` of C in C's dtype; with `GATED` (N = 2I output
    columns of gate, then up), `acc` is already `silu(gate) * up` over `BLOCK_N // 2` columns."""
    width = N // 2 if GATED else N
    TILE_N: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    cols = pid_n * TILE_N + tl.arange(0, TILE_N)
    ptrs = C + slots[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(ptrs, acc.to(C.dtype.element_ty), mask=live[:, None] & (cols[None, :] < width))


@triton.jit
def _descriptor_products(
    a_rows,
    live,
    WeightRows,
    first_row,
    K,
    half,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The float32 `[BLOCK_M, ROWS]` products of A rows `a_rows` with the weight rows from
    `first_row` of the descriptor `WeightRows` and, with `GATED`, with those `half` rows further
    on (else the first product twice). A TMA tile is one run of consecutive rows, so gate and up
    are two products here, their K steps sharing each A tile."""
    acc = tl.zeros((BLOCK_M, ROWS), tl.float32)
    second = tl.zeros((BLOCK_M, ROWS), tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + offs_k[None, :], mask=live[:, None] & (offs_k < K)[None, :], other=0.0)
        b = WeightRows.load([first_row, k_block * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        if GATED:
            b = WeightRows.load([first_row + half, k_block * BLOCK_K])
            second = tl.dot(a, b.T, second, input_precision=PRECISION)
    if GATED:
        return acc, second
    return acc, acc


@triton.jit
def _outer_scales(a_scales, b_scales, live, rows_ok):
    """`a_scales[row] * b_scales[col]` over a tile (the pointers of its rows' and weight rows'
    scales), 0 where masked: what an FP8 product of the tile is multiplied by."""
    a_scale = tl.load(a_scales, mask=live, other=0.0)
    b_scale = tl.load(b_scales, mask=rows_ok, other=0.0)
    return a_scale[:, None] * b_scale[None, :]


# one variant for every batch size: the token-dependent arguments are not specialized
@triton.jit(do_not_specialize=["num_pairs", "max_rows"])
def _grouped_gemm_kernel(
    A,
    B,
    WeightRows,
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
    AScale,
    BScale,
    stride_asm,
    stride_ask,
    stride_bse,
    stride_bsn,
    stride_bsk,
    PAIRS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """C[pair] = A[pair // PAIRS_PER_ROW] @ B[expert]^T for the `BLOCK_M` sorted pairs of one
    block (padding rows masked); programs of blocks past the padded total exit. With `GATED`, a
    tile covers gate and up columns c..c + BLOCK_N / 2 and stores silu(gate) * up. `WeightRows`:
    B as a `[E * N, K]` tensor descriptor (None: B's rows by pointer, gate and up rows
    interleaved in one tile). With `FP8`, A and B are e4m3 with float32 scales: AScale `[rows,
    groups]`, BScale per weight row (`GROUP_N` 1, `GROUP_K` 0: per channel, applied once) or per
    `GROUP_N` x `GROUP_K` block (applied at each K step, which `BLOCK_K` dividing `GROUP_K` keeps
    within one group)."""
    wait_for_producers(USE_PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), max_rows, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPostPad):
        return
    slots = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = slots < num_pairs
    a_index = (slots // PAIRS_PER_ROW).to(tl.int64)
    a_rows = A + a_index[:, None] * stride_am
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    if WeightRows is not None:
        TILE_N: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
        first = (expert * N + pid_n * TILE_N).to(tl.int32)
        acc, up = _descriptor_products(
            a_rows, live, WeightRows, first, K, N // 2, BLOCK_M, TILE_N, BLOCK_K, GATED, PRECISION
        )
        if GATED:
            acc = silu_mul_rounded(acc, up, C.dtype.element_ty)
        _store_tile(C, acc, slots, live, pid_n, N, stride_cm, BLOCK_M, BLOCK_N, GATED)
        return
    rows, rows_ok = _weight_rows(pid_n, N, BLOCK_N, GATED)
    b_rows = B + expert * stride_be + rows.to(tl.int64)[None, :] * stride_bn
    if FP8:
        a_scales = AScale + a_index * stride_asm
        b_scales = BScale + expert * stride_bse + (rows // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + offs_k[:, None], mask=k_ok[:, None] & rows_ok[None, :], other=0.0)
        if GROUP_K:
            group = k_block * BLOCK_K // GROUP_K
            scales = _outer_scales(
                a_scales + group * stride_ask, b_scales + group * stride_bsk, live, rows_ok
            )
            acc += tl.dot(a, b) * scales
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if FP8 and not GROUP_K:
        acc *= _outer_scales(a_scales, b_scales, live, rows_ok)
    if GATED:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        acc = silu_mul_rounded(gate, up, C.dtype.element_ty)
    _store_tile(C, acc, slots, live, pid_n, N, stride_cm, BLOCK_M, BLOCK_N, GATED)


class _Fp8Scales(NamedTuple):
    """What an FP8 grouped GEMM scales by: A's float32 scales (`[rows, 1]`, per token or static,
    or `[rows, groups]`), the weight's (`[E, N]` per channel, `[E, ceil(N/bn), ceil(K/bk)]` per
    block) and the block (None: per channel)."""

    a: torch.Tensor
    weight: torch.Tensor
    block: Block | None


def _quantized(
    a: torch.Tensor, fp8: Fp8ExpertScales | None, first: bool
) -> tuple[torch.Tensor, _Fp8Scales | None]:
    """A of the first (`w13`) or second (`w2`) GEMM as the kernel reads it: as it is without
    `fp8`, else e4m3 with its scales, quantized as `torch_experts` quantizes it."""
    if fp8 is None:
        return a, None
    weight_scale, static = (fp8.w13, fp8.w13_input) if first else (fp8.w2, fp8.w2_input)
    group = None if fp8.block_size is None else fp8.block_size[1]
    if a.device.type == "cuda":  # one launch, where the torch code takes several
        from replaylm.layers.quantization import fp8_kernels

        a_q, a_scale = fp8_kernels.quantize_activation(a, group, static)
    else:
        a_q, a_scale = quantize_activation(a, group, static)
    return a_q, _Fp8Scales(a_scale, weight_scale, fp8.block_size)


def _scale_args(scales: _Fp8Scales | None) -> dict[str, Any]:
    """The grouped GEMM kernel's FP8 arguments for `scales` (None: not FP8)."""
    if scales is None:
        strides = ("stride_asm", "stride_ask", "stride_bse", "stride_bsn", "stride_bsk")
        return {"AScale": None, "BScale": None, **dict.fromkeys(strides, 0)} | {
            "FP8": False,
            "GROUP_N": 1,
            "GROUP_K": 0,
        }
    a_scale, weight_scale, block = scales
    group_n, group_k = (1, 0) if block is None else block
    return {
        "AScale": a_scale,
        "BScale": weight_scale,
        "stride_asm": a_scale.stride(0),
        "stride_ask": a_scale.stride(1),
        "stride_bse": weight_scale.stride(0),
        "stride_bsn": weight_scale.stride(1),
        "stride_bsk": 0 if block is None else weight_scale.stride(2),
        "FP8": True,
        "GROUP_N": group_n,
        "GROUP_K": group_k,
    }


def _grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pairs_per_row: int,
    gated: bool,
    config: MoeBlockConfig,
    scales: _Fp8Scales | None = None,
    weight_tma: bool = False,
) -> None:
    """Launch the grouped GEMM of `a` `[rows, K]` by `weight` `[E, N, K]` into `out`, over the
    sorted pairs `routing` (`moe_align_block_size`'s result); FP8 (e4m3 `a` and `weight`) with
    `scales`; `weight_tma`: the weight's tiles through a tensor descriptor (`tma_weights`)."""
    sorted_ids, expert_ids, num_post_pad = routing
    experts, n, k = weight.shape
    max_rows = sorted_ids.numel()
    tiles_n = triton.cdiv(n, config.block_n)
    descriptor = None
    if weight_tma:
        rows = config.block_n // 2 if gated else config.block_n
        flat = weight.view(experts * n, k)
        descriptor = TensorDescriptor.from_tensor(flat, [rows, config.block_k])
    _grouped_gemm_kernel[(triton.cdiv(max_rows, config.block_m) * tiles_n,)](
        a,
        weight,
        descriptor,
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
        **_scale_args(scales),
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


# fewer tokens reach few experts, whose weight tiles came slower by TMA than by pointer
TMA_MIN_TOKENS = 16


@functools.lru_cache(maxsize=16)
def _has_tma(device: torch.device) -> bool:
    """Whether `device` loads tiles by TMA: a CUDA GPU of compute capability 9.0 or newer, or the
    CPU, where the kernels run only in Triton's interpreter (which emulates descriptors)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def tma_weights(weight: torch.Tensor, fp8: Fp8ExpertScales | None) -> bool:
    """Whether the grouped GEMMs can read `weight` `[E, N, K]` through a tensor descriptor: its
    tiles then come by TMA, which keeps more of them in flight than pointer loads do. Unquantized,
    contiguous weights whose rows start 16-byte aligned (TMA's rule), on a GPU that has TMA;
    FP8 experts keep the pointer loads, whose tiles the scales follow."""
    aligned = weight.data_ptr() % 16 == 0 and weight.shape[2] * weight.element_size() % 16 == 0
    return fp8 is None and weight.is_contiguous() and aligned and _has_tma(weight.device)


def _check(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    fp8: Fp8ExpertScales | None,
) -> None:
    """ValueError for operands the kernels do not take."""
    num_experts, two_i, width = w13.shape
    if hidden.dim() != 2 or width != hidden.shape[1] or two_i % 2:
        raise ValueError(f"hidden {list(hidden.shape)} does not fit w13 {list(w13.shape)}")
    if w2.shape != (num_experts, width, two_i // 2):
        raise ValueError(f"w2 {list(w2.shape)} does not fit w13 {list(w13.shape)}")
    weight_dtype = hidden.dtype if fp8 is None else FP8_DTYPE
    if w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(f"weights {w13.dtype}/{w2.dtype}: {weight_dtype} expected")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("the expert weights must be contiguous along their last dim")
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {list(ids.shape)} does not fit hidden {list(hidden.shape)}")
    if fp8 is not None:
        _check_scales(w13, w2, fp8)


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, fp8: Fp8ExpertScales) -> None:
    """ValueError for FP8 weight scales of another shape than `Fp8ExpertScales` says, or block
    scales whose blocks split an expert's gate and up rows (they are held apart)."""
    block = fp8.block_size
    intermediate = w2.shape[2]
    if block is not None and intermediate % block[0]:
        raise ValueError(
            f"FP8 block scales: {intermediate} intermediate columns are not whole blocks of "
            f"{block[0]}"
        )
    for name, weight, scale in (("w13", w13, fp8.w13), ("w2", w2, fp8.w2)):
        experts, n, k = weight.shape
        expected = (experts, *scale_shape(n, k, block))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{name} scales {list(scale.shape)}: {list(expected)} expected")


def triton_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp8: Fp8ExpertScales | None = None,
    config: MoeBlockConfig | None = None,
    defer_sum: bool = False,
    weight_tma: bool | None = None,
) -> torch.Tensor | RoutedRows:
    """`torch_experts`'s contract (an id outside 0..E-1 adds nothing; `fp8`: the scales of e4m3
    weights, run w8a8) in four to six launches, plus each GEMM's input quantization with FP8, and no
    host sync; up to `PAIR_TOKENS` tokens of non-FP8 experts in two (`pair_experts`, unsorted).
    `config` overrides `moe_block_config`'s choice for this shape and token count and takes the
    sorted route (with block scales its BLOCK_K must divide the blocks' columns: ValueError).
    `defer_sum`: the sorted route returns its rows before the weighted sum (`RoutedRows`), one
    launch less, for a reader that sums them itself. `weight_tma` overrides the choice of weight
    loads for the sorted route (`_tma`; True needs weights `tma_weights` allows)."""
    _check(hidden, w13, w2, topk_ids, fp8)
    tokens, width = hidden.shape
    num_experts, intermediate, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if tokens == 0:
        return hidden.new_empty((0, width))
    if config is None and fp8 is None and 0 < config_tokens(tokens) <= PAIR_TOKENS:
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        return pair_experts(as_rows(hidden, width), w13, w2, weights, ids)
    block = None if fp8 is None else fp8.block_size
    if config is None:
        place = device_name(hidden.device)
        config, _ = moe_block_config(
            num_experts, intermediate, width, config_tokens(tokens), w13.dtype, place, block
        )
    if not fits_block(config, block):
        raise ValueError(f"BLOCK_K {config.block_k} does not divide the FP8 blocks {block}")
    ids = topk_ids.to(torch.int32).contiguous()
    routing = moe_align_block_size(ids, num_experts, config.block_m)
    act = hidden.new_empty((tokens * top_k, intermediate))
    a, scales = _quantized(as_rows(hidden, width), fp8, first=True)
    _grouped_gemm(
        a, w13, act, routing, top_k, True, config, scales, _tma(w13, fp8, weight_tma, tokens)
    )
    down = hidden.new_empty((tokens * top_k, width))
    a, scales = _quantized(act, fp8, first=False)
    _grouped_gemm(a, w2, down, routing, 1, False, config, scales, _tma(w2, fp8, weight_tma, tokens))
    routed = RoutedRows(down, topk_weights.to(torch.float32).contiguous(), ids, num_experts)
    return routed if defer_sum else weighted_sum(routed)


def _tma(
    weight: torch.Tensor, fp8: Fp8ExpertScales | None, asked: bool | None, tokens: int
) -> bool:
    """`triton_experts`' `weight_tma` for `weight` and a batch of `tokens`: `asked`, else from
    `TMA_MIN_TOKENS` tokens (the count `config_tokens` gives) where `tma_weights` allows."""
    if asked is None:
        return config_tokens(tokens) >= TMA_MIN_TOKENS and tma_weights(weight, fp8)
    if asked and not tma_weights(weight, fp8):
        raise ValueError("these expert weights cannot be read through a tensor descriptor")
    return asked


def _op_fp8_args(
    fp8: Fp8ExpertScales | None,
) -> tuple[
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    list[int] | None,
]:
    """`fp8` as the custom op's trailing arguments (its schema takes tensors and lists)."""
    if fp8 is None:
        return None, None, None, None, None
    block = None if fp8.block_size is None else list(fp8.block_size)
    return fp8.w13, fp8.w2, fp8.w13_input, fp8.w2_input, block


def _op_fp8(
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_input_scale: torch.Tensor | None,
    w2_input_scale: torch.Tensor | None,
    block_size: list[int] | None,
) -> Fp8ExpertScales | None:
    """The `Fp8ExpertScales` of the custom op's trailing arguments (`_op_fp8_args`'s inverse)."""
    if w13_scale is None or w2_scale is None:
        return None
    block = None if block_size is None else (block_size[0], block_size[1])
    return Fp8ExpertScales(w13_scale, w2_scale, block, w13_input_scale, w2_input_scale)


@torch.library.custom_op("replaylm::fused_experts", mutates_args=())
def _fused_experts_op(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    block_size: list[int] | None = None,
) -> torch.Tensor:
    fp8 = _op_fp8(w13_scale, w2_scale, w13_input_scale, w2_input_scale, block_size)
    out = triton_experts(hidden, w13, w2, topk_weights, topk_ids, fp8)
    assert isinstance(out, torch.Tensor)  # summed: no defer_sum
    return out


@_fused_experts_op.register_fake
def _(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    block_size: list[int] | None = None,
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


def triton_fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp8: Fp8ExpertScales | None = None,
    defer_sum: bool = False,
) -> torch.Tensor | RoutedRows:
    """`triton_experts` with its own config choice: a direct call when run eagerly (`defer_sum`
    as its), the custom op `replaylm::fused_experts` (`fp8`'s scales as its trailing arguments,
    the sum taken) when torch.compile traces it."""
    if not torch.compiler.is_compiling():
        return triton_experts(hidden, w13, w2, topk_weights, topk_ids, fp8, defer_sum=defer_sum)
    return torch.ops.replaylm.fused_experts(
        hidden, w13, w2, topk_weights, topk_ids, *_op_fp8_args(fp8)
    )
