"""Per-token e4m3 quantization inside Triton kernels: the scale of an amax and the values
divided by it and rounded onto e4m3's grid, as `quantization.fp8.quantize_activation` computes
them bit for bit (correctly rounded divisions; the torch code's on the CPU, where CUDA's torch
multiplies by 1/448 instead) and round-to-nearest-even done in float32 (Triton's interpreter
rounds the float32 -> e4m3 cast wrongly), so the cast itself is exact. The kernels that quantize
an activation share these: the quantization launch, the RMSNorm and SiluAndMul that quantize
their outputs, and the skinny matmul that quantizes its input as it loads it."""

from __future__ import annotations

import triton
import triton.language as tl

from replaylm.layers.quantization.fp8 import FP8_MAX, MIN_AMAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)
# float32 exponent fields: e4m3's least normal binade (2^-6; below it the spacing stays 2^-9),
# and how far above a binade a float32's spacing is e4m3's in it (23 - 3 mantissa bits)
_MIN_NORMAL_FIELD = tl.constexpr(121 << 23)
_SPACING_SHIFT = tl.constexpr(20 << 23)


@triton.jit
def round_to_e4m3(y):
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
def amax_scale(amax):
    """The scale of values whose largest magnitude is `amax`: amax over 448, the amax at least
    MIN_AMAX, correctly rounded."""
    return tl.math.div_rn(tl.maximum(amax, _MIN_AMAX), _FP8_MAX)


@triton.jit
def token_scale(x):
    """The per-token (or per-group) scale of `x` (float32, any shape: one token's values)."""
    return amax_scale(tl.max(tl.abs(x)))


@triton.jit
def scaled_e4m3(x, scale):
    """`x / scale` saturated to +-448 and rounded onto e4m3's grid (still float32)."""
    return round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX))
