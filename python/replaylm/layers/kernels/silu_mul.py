"""SiluAndMul in one launch: `[..., 2I] -> [..., I]`, `silu(gate) * up`.

Same numbers as the torch code: silu in float32 rounded to the input dtype, times `up` in
float32, rounded again (ulp-level differences from exp only). The input may have any row stride
(unit column stride); the output is a fresh contiguous tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import as_rows, pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers


@triton.jit
def silu_mul_rounded(gate, up, dtype):
    """float32 `silu(gate) * up` of float32 tiles, as the torch code computes SiluAndMul of a
    `dtype` input: gate and up rounded to `dtype` first, silu rounded to it before the product.
    Every kernel with SiluAndMul in it (this launch, the matmuls' gated epilogues) takes it."""
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return silu * up.to(dtype).to(tl.float32)


@triton.jit
def silu_mul_columns(X, row, cols, mask, width, stride_x):
    """`silu(gate) * up` of `row`'s columns `cols` (gate and up the row's halves, `width` each),
    in the input dtype, rounded as the torch code rounds it (zeros where not `mask`)."""
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + width + cols, mask=mask, other=0.0)
    return silu_mul_rounded(gate.to(tl.float32), up.to(tl.float32), gate.dtype).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(X, Out, width, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_producers(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    tl.store(
        Out + row * width + cols, silu_mul_columns(X, row, cols, mask, width, stride_x), mask=mask
    )


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for `x` `[..., 2I]`; `block` (a power of two) columns
    per program."""
    width = x.shape[-1] // 2
    x2 = as_rows(x, 2 * width)
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
            x2,
            out,
            width,
            x2.stride(0),
            BLOCK=block,
            num_warps=4,
            **pdl_launch(),
        )
    return out
