"""RMSNorm with an optional fused residual add, in one launch.

Same numbers as the torch code of `RMSNorm` (HF semantics): with a residual, the sum `s = x + r`
is rounded to its dtype (stored as the new residual); then `weight * (s_f32 * rsqrt(mean(s_f32^2)
+ eps)).to(s.dtype)`. Only the reduction order and rsqrt differ (ulp-level). The input is read
as rows of its last dim (any row stride); outputs are fresh tensors shaped like `x`.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import as_rows, pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers


@triton.jit
def summed_rows(
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
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    ExpertWeights,
    ExpertIds,
    num_experts,
    TOP_K: tl.constexpr,
):
    """The norm's input at `rows` x `cols` (int64 `[R, 1]`, `[1, C]`): X's rows, or with `TOP_K`
    (> 0) the weighted sum of X's rows t * TOP_K + s by `ExpertWeights[t, s]` (slots of
    `ExpertIds` outside 0..num_experts-1 skipped) in float32 rounded to X's dtype, as the MoE's
    weighted-sum launch computes it; with `HAS_RESIDUAL` plus R's, rounded to ResOut's dtype
    (and stored there with `STORE_RESIDUAL`)."""
    if TOP_K > 0:
        acc = tl.zeros((rows.shape[0], cols.shape[1]), tl.float32)
        for s in tl.static_range(TOP_K):
            pair = rows * TOP_K + s
            expert = tl.load(ExpertIds + pair, mask=rows < n_rows, other=-1)
            ok = (expert >= 0) & (expert < num_experts)
            y = tl.load(X + pair * stride_x + cols, mask=mask & ok, other=0.0).to(tl.float32)
            acc += tl.load(ExpertWeights + pair, mask=ok, other=0.0) * y
        x = acc.to(X.dtype.element_ty)
    else:
        x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ResOut.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(ResOut + rows * n_cols + cols, x, mask=mask)
    return x


@triton.jit
def row_rstd(x, n_cols, eps):
    """`rsqrt(mean(x^2) + eps)` of each row of `x` (its whole rows, zeros past n_cols), `[R]`."""
    xf = x.to(tl.float32)
    return tl.math.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)


@triton.jit
def weighted_norm(x, rstd, W, cols, n_cols):
    """`weight * (x * rstd)` at `cols`, the product rounded to x's dtype as the torch code
    rounds it, the weight's product in float32 (not yet rounded)."""
    normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
    return tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) * normed


@triton.jit
def norm_rows(
    X,
    R,
    W,
    ResOut,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ExpertWeights,
    ExpertIds,
    num_experts,
    TOP_K: tl.constexpr,
):
    """This program's BLOCK_ROWS rows normalized (the residual sum stored to ResOut first, with
    `HAS_RESIDUAL`; with `TOP_K` each a weighted sum of expert rows: `summed_rows`): (`weight *
    normed` in float32, not yet rounded, and the rows, columns and mask to store it at, rows
    `[BLOCK_ROWS, 1]` and columns `[1, BLOCK_D]`)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    rows = rows.to(tl.int64)
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
    return weighted_norm(x, row_rstd(x, n_cols, eps), W, cols, n_cols), rows, cols, mask


@triton.jit(do_not_specialize=["n_rows"])  # one variant for every row count
def _rms_norm_kernel(
    X,
    R,
    W,
    Out,
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
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOP_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
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
        BLOCK_ROWS,
        BLOCK_D,
        ExpertWeights,
        ExpertIds,
        num_experts,
        TOP_K,
    )
    tl.store(Out + rows * n_cols + cols, y.to(Out.dtype.element_ty), mask=mask)


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rmsnorm(x) * weight` over the last dim; with `residual`, `(rmsnorm(x + residual) * weight,
    x + residual)`. Dtypes promote as in torch (bf16, fp16, fp32)."""
    x2 = as_rows(x, x.shape[-1])
    return _launch(x2, x.shape, weight, eps, residual, None)


def rms_norm_of_expert_sum(
    rows: torch.Tensor,
    expert_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm(x, weight, eps, residual)` of x `[T, H]`, each token's expert rows `rows`
    `[T * top_k, H]` weighted by `expert_weights` `[T, top_k]` (float32) and summed (slots of
    `expert_ids` `[T, top_k]` outside 0..num_experts-1 skipped), in one launch: the numbers of
    the MoE's weighted-sum launch then `rms_norm`, bit for bit."""
    tokens, top_k = expert_ids.shape
    width = rows.shape[-1]
    shape = (tokens, width)
    experts = (expert_weights, expert_ids, num_experts)
    out = _launch(as_rows(rows, width), shape, weight, eps, residual, experts)
    assert isinstance(out, tuple)  # with a residual
    return out


def _launch(
    x2: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    experts: tuple[torch.Tensor, torch.Tensor, int] | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The norm of x `shape` read from the rows `x2` (with `experts`, each row a weighted sum of
    its expert rows of x2: `rms_norm_of_expert_sum`)."""
    width = shape[-1]
    dtype = x2.dtype
    sum_dtype = dtype if residual is None else torch.promote_types(dtype, residual.dtype)
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x2.device)
    res_out = None if residual is None else torch.empty(shape, dtype=sum_dtype, device=x2.device)
    r2 = x2 if residual is None else as_rows(residual, width)
    n_rows = out.numel() // width if width else 0
    block_d = triton.next_power_of_2(width)
    block_rows = max(1, 1024 // block_d)  # several short rows (per-head norms) per program
    expert_weights, expert_ids, num_experts = experts or (x2, x2, 0)
    if n_rows:
        _rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
            x2,
            r2,
            weight,
            out,
            out if res_out is None else res_out,
            n_rows,
            width,
            x2.stride(0),
            r2.stride(0),
            eps,
            expert_weights,
            expert_ids,
            num_experts,
            HAS_RESIDUAL=residual is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            TOP_K=0 if experts is None else expert_ids.shape[1],
            num_warps=min(max(block_d * block_rows // 256, 1), 8),
            **pdl_launch(),
        )
    return out if res_out is None else (out, res_out)
