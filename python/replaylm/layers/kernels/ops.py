"""The layers' entry points to the fused kernels: a direct launch when run eagerly, a torch custom
op (`replaylm::rms_norm`, `add_rms_norm`, `silu_and_mul`, `linear`, which may end in SiluAndMul)
under torch.compile. (The q/k norm + rope kernel stores K/V as well: under torch.compile it is
the attention context's op `replaylm::rope_store_kv`, see `layers.attention.ops`.)

Inside compiled code (tc_piecewise with `kernels="fused"`, see `kernels_in_compiled_code`) the
custom ops keep each kernel whole: Inductor calls it as it is instead of re-deriving its own
fusion from the torch code, so a compiled piece computes the very numbers of the eager model.
Eager calls skip the custom-op dispatch, whose host time per call a decode step would wait
through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replaylm.layers.kernels import converted, cublas_linear
from replaylm.layers.kernels import rmsnorm as _rmsnorm
from replaylm.layers.kernels import silu_mul as _silu_mul
from replaylm.layers.kernels import skinny_matmul as _skinny


@torch.library.custom_op("replaylm::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rmsnorm.rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op("replaylm::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rmsnorm.rms_norm(x, weight, eps, residual)


@_add_rms_norm_op.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (
        x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype)),
        x.new_empty(x.shape, dtype=sum_dtype),
    )


@torch.library.custom_op("replaylm::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return _silu_mul.silu_and_mul(x)


@_silu_and_mul_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    all_rows: bool,
    gated_silu: bool,
    out_dtype: torch.dtype | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if all_rows:
        return _skinny.skinny_matmul(
            x,
            weight,
            bias,
            _skinny.INVARIANT_CONFIG,
            gated_silu=gated_silu,
            out_dtype=out_dtype,
            out=out,
        )
    if x.numel() <= _skinny.MAX_ROWS * x.shape[-1]:
        return _skinny.skinny_matmul(
            x, weight, bias, gated_silu=gated_silu, out_dtype=out_dtype, out=out
        )
    if not gated_silu:
        return cublas_linear(x, weight, bias, out_dtype, out)
    return converted(_silu_mul.silu_and_mul(F.linear(x, weight, bias)), out_dtype, out)


@torch.library.custom_op("replaylm::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    all_rows: bool,
    gated_silu: bool,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    return _linear(x, weight, bias, all_rows, gated_silu, out_dtype)


@_linear_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    all_rows: bool,
    gated_silu: bool,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    return x.new_empty(
        (*x.shape[:-1], weight.shape[0] // 2 if gated_silu else weight.shape[0]),
        dtype=out_dtype or x.dtype,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`kernels.rmsnorm.rms_norm` (same contract), as a custom op when compiling."""
    if not torch.compiler.is_compiling():
        return _rmsnorm.rms_norm(x, weight, eps, residual)
    if residual is None:
        return torch.ops.replaylm.rms_norm(x, weight, eps)
    return torch.ops.replaylm.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`kernels.silu_mul.silu_and_mul` (same contract), as a custom op when compiling."""
    if not torch.compiler.is_compiling():
        return _silu_mul.silu_and_mul(x)
    return torch.ops.replaylm.silu_and_mul(x)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    all_rows: bool = False,
    gated_silu: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)`: the skinny kernel (`kernels.skinny_matmul`) for at most
    `MAX_ROWS` rows, else `F.linear`; decided per call at run time, so also under torch.compile,
    where the row count is symbolic (a custom op there). `all_rows`: the kernel for any number of
    rows, K unsplit (batch-invariant rows). `gated_silu`: `weight` is `[gate; up]` and the result
    SiluAndMul of the product (in the skinny kernel's epilogue; after F.linear, its own launch).
    `out_dtype`: the result's dtype (default x's; the skinny kernel writes it from its float32
    sums, F.linear's result is converted). `out`: a contiguous tensor of the result's shape and
    dtype to write instead of a new one (eager calls only)."""
    if not torch.compiler.is_compiling():
        return _linear(x, weight, bias, all_rows, gated_silu, out_dtype, out)
    if out is not None:
        raise ValueError("linear(out=...) is for eager calls, not compiled code")
    return torch.ops.replaylm.linear(x, weight, bias, all_rows, gated_silu, out_dtype)
