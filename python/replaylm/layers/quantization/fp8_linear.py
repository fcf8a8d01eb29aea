"""The FP8 matmul: `x @ (q * scale).T (+ bias)`, its input quantized to FP8 first.

On CUDA (the kernels' device, `KERNEL_DEVICE_TYPE`), the input is quantized per token (or with
the layer's static scale) to e4m3 by a Triton kernel (`fp8_kernels.quantize_activation`: one
launch, where the torch code takes several). Per-channel weights times at most `SKINNY_ROWS`
rows (decode) then run the skinny matmul, FP8 dots with both scales on its float32 sums (a
decode matmul is bound by reading the weight, which FP8 halves; cuBLASLt's FP8 GEMM at a few
rows is slower than bf16's, docs/tuning.md "FP8 GEMMs"). More rows run `torch._scaled_mm`
(compute capability 8.9+), the input's row scales `[T, 1]` and the weight's column scales
`[1, N]` applied in the GEMM's epilogue (row-wise scaling; K and N multiples of 16, the weight
read column-major: `q.t()` of the row-major `[N, K]` weight). The input may come quantized
already, by the RMSNorm or SiluAndMul before it (`QuantizedRows`). Block scales run the
block-scaled Triton GEMM (`fp8_kernels.block_fp8_linear`), the input quantized per token and
`block_size[1]`-column group.

Elsewhere (the CPU) the matmul is emulated: the weight dequantized to float32 for each call, the
input quantized and dequantized exactly as the GPU path quantizes it (per token, or per token
and block-column group for block scales), one float32 F.linear, the result cast to the
output dtype. The emulation is the GPU paths' reference and what the CPU tests run; it saves
no memory bandwidth or time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replaylm.layers import kernels
from replaylm.layers.quantization.fp8 import (
    Activation,
    Block,
    QuantizedRows,
    dequantize_activation,
    dequantize_weight,
    quantize_activation,
)

# up to this many rows (decode) per-channel weights run in the skinny kernel (its FP8_MAX_ROWS)
SKINNY_ROWS = 64


def fp8_linear(
    x: Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Block | None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x` `[..., K]` times the FP8 weight `[N, K]` (e4m3) with `weight_scale` (`[N]` per
    channel, or per `block_size` block), plus `bias`, in `out_dtype` (default x's). The input is
    quantized per token (per token and `block_size[1]`-column group with block scales), or with
    `input_scale` (static: the largest of the layer's input scales). CUDA: `torch._scaled_mm` or
    the block-scaled Triton GEMM; the CPU: the emulation (the module docstring's). `x` may come
    quantized already (`QuantizedRows`, per token, made on the kernels' device for a per-channel
    layer with dynamic scales): the GPU matmul then takes it as it is."""
    out_dtype = out_dtype or x.dtype
    if isinstance(x, QuantizedRows):
        y = _channel_mm(x.q, x.scale, weight, weight_scale, out_dtype)
        return y if bias is None else y + bias
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type == kernels.KERNEL_DEVICE_TYPE:
        y = _scaled_mm(rows, weight, weight_scale, block_size, out_dtype, input_scale)
    else:
        y = _emulated(rows, weight, weight_scale, block_size, input_scale).to(out_dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def takes_skinny(x: Activation, block_size: Block | None) -> bool:
    """Whether `fp8_linear` runs `x` in the skinny kernel: per-channel scales, at most
    SKINNY_ROWS rows, on the kernels' device, outside torch.compile's tracing (checked before
    the rows: a traced row count cannot be compared)."""
    rows = _values(x)
    return (
        block_size is None
        and not torch.compiler.is_compiling()
        and kernels.use_triton_kernels(rows)
        and rows.numel() <= SKINNY_ROWS * rows.shape[-1]
    )


def gated_fp8_linear(
    x: Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiluAndMul of `fp8_linear(x, weight, weight_scale, None, bias, input_scale=input_scale)`
    for a `[gate; up]` per-channel weight, the input quantized (unless it comes quantized) and
    then one skinny launch (SiluAndMul in its epilogue), where `takes_skinny`: the MLP's gate-up
    and activation with no intermediate tensor and one launch less."""
    from replaylm.layers.kernels.skinny_matmul import skinny_matmul

    rows = _values(x)
    q = (
        x
        if isinstance(x, QuantizedRows)
        else _quantized(rows.reshape(-1, rows.shape[-1]), input_scale)
    )
    y = skinny_matmul(
        q.q,
        weight,
        bias,
        gated_silu=True,
        out_dtype=q.dtype,
        weight_scale=weight_scale,
        x_scale=q.scale,
    )
    return y.reshape(*rows.shape[:-1], -1)


def _values(x: Activation) -> torch.Tensor:
    """The tensor of an activation's values (a quantized one's e4m3 values)."""
    return x.q if isinstance(x, QuantizedRows) else x


def _quantized(rows: torch.Tensor, input_scale: torch.Tensor | None) -> QuantizedRows:
    """`rows` `[T, K]` quantized per token (or with the static `input_scale`)."""
    return QuantizedRows(*_quantize_per_token(rows, input_scale), rows.dtype)


def _scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Block | None,
    out_dtype: torch.dtype,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The GPU's FP8 GEMM: with block scales the block-scaled Triton GEMM; else row-wise scaled
    `torch._scaled_mm`, scale_a `[T, 1]`, scale_b `[1, N]`, both float32 and contiguous."""
    if block_size is not None:
        # imported here: triton is optional, and only this route needs it
        from replaylm.layers.quantization import fp8_kernels

        return fp8_kernels.block_fp8_linear(x, weight, weight_scale, block_size, out_dtype)
    if torch.compiler.is_compiling():
        # torch._scaled_mm's shape checks guard on the traced batch size, which the compiled
        # pieces leave symbolic: the quantization and the GEMM stay one opaque op
        return torch.ops.replaylm.fp8_scaled_mm(x, weight, weight_scale, out_dtype, input_scale)
    return _channel_scaled_mm(x, weight, weight_scale, out_dtype, input_scale)


def _channel_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    x_q, x_scale = _quantize_per_token(x, input_scale)
    return _channel_mm(x_q, x_scale, weight, weight_scale, out_dtype)


def _channel_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The per-token quantized `x_q` `[T, K]` (scales `[T, 1]`) times the per-channel weight:
    the skinny kernel at decode rows where the kernels run, else row-wise `torch._scaled_mm`."""
    if x_q.shape[0] <= SKINNY_ROWS and kernels.use_triton_kernels(x_q):
        from replaylm.layers.kernels.skinny_matmul import skinny_matmul

        return skinny_matmul(
            x_q, weight, out_dtype=out_dtype, weight_scale=weight_scale, x_scale=x_scale
        )
    # fast accumulation (in the tensor cores, no periodic float32 promotion): the FP8 GEMMs of
    # SGLang's and vLLM's CUTLASS kernels accumulate so too (docs/tuning.md, "FP8 GEMMs")
    y = torch._scaled_mm(
        x_q,
        weight.t(),
        scale_a=x_scale,
        scale_b=weight_scale.reshape(1, -1),
        out_dtype=torch.bfloat16,  # row-wise scaling writes bf16 only
        use_fast_accum=True,
    )
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


@torch.library.custom_op("replaylm::fp8_scaled_mm", mutates_args=())
def _channel_scaled_mm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    return _channel_scaled_mm(x, weight, weight_scale, out_dtype, input_scale)


@_channel_scaled_mm_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


def _quantize_per_token(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation(x, static_scale=input_scale)`: the Triton kernel where the layers run
    their kernels; the torch code inside `native_only()`."""
    if kernels.use_triton_kernels(x):
        from replaylm.layers.quantization import fp8_kernels

        return fp8_kernels.quantize_activation(x, static_scale=input_scale)
    return quantize_activation(x, static_scale=input_scale)


def _emulated(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Block | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The GPU path's numbers in float32: the quantized input times the dequantized weight."""
    group = None if block_size is None else block_size[1]
    x_q, x_scale = quantize_activation(x, group, input_scale)
    return F.linear(
        dequantize_activation(x_q, x_scale, group),
        dequantize_weight(weight, weight_scale, block_size),
    )
