"""Triton kernels of the layers, one launch each: RMSNorm (+ residual add), per-head q/k RMSNorm
+ rope (+ the KV store), SiluAndMul, the skinny matmul and the sampler's draw; and the switches
they share (the route, PDL). Why small ops get kernels of their own: docs/tuning.md, "Fused
elementwise kernels".

Importing this package does not import triton (triton is optional); its kernel modules do, so the
layers import them (through `ops`) only on the route `use_triton_kernels` picks. The layers' torch
code stays the native path: it runs on the CPU, inside `native_only()`, and under torch.compile
unless `kernels_in_compiled_code()` is active (then the traced graph calls the kernels as opaque
custom ops; otherwise Inductor fuses the traced torch ops itself).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_HAS_TRITON = importlib.util.find_spec("triton") is not None
# The device type the kernels run on; the CPU tests set "cpu" to run the layers' Triton route in
# Triton's interpreter.
KERNEL_DEVICE_TYPE = "cuda"
_native_only = False
_kernels_when_compiling = False
_pdl = False


def use_triton_kernels(x: torch.Tensor) -> bool:
    """True when a layer given `x` should run its fused Triton kernel: `x` is on CUDA
    (`KERNEL_DEVICE_TYPE`), triton is installed, no `native_only()` is active, and torch.compile
    is not tracing unless inside `kernels_in_compiled_code()`. Reads the device and flags only:
    no host sync."""
    return (
        x.device.type == KERNEL_DEVICE_TYPE
        and _HAS_TRITON
        and not _native_only
        and (_kernels_when_compiling or not torch.compiler.is_compiling())
    )


def use_opaque_kernel(x: torch.Tensor) -> bool:
    """True when a layer whose torch code syncs with the host (so neither Inductor nor a CUDA
    graph can take it) should run its Triton kernel: `use_triton_kernels`'s conditions, but
    under torch.compile always, as an opaque custom op."""
    return x.device.type == KERNEL_DEVICE_TYPE and _HAS_TRITON and not _native_only


def pdl_supported(device: torch.device) -> bool:
    """PDL needs a CUDA GPU of compute capability 9.0 or newer (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def check_pdl(enabled: bool, device: torch.device) -> None:
    """Raise ValueError when `--enable-pdl` is asked for on a device without it."""
    if not enabled or pdl_supported(device):
        return
    if device.type != "cuda":
        raise ValueError(f"--enable-pdl needs a CUDA GPU of compute capability 9.0+, not {device}")
    major, minor = torch.cuda.get_device_capability(device)
    raise ValueError(
        f"--enable-pdl needs compute capability 9.0+ (Hopper); "
        f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
    )


def choose_pdl(asked: bool | None, supported: bool) -> tuple[bool, str]:
    """(whether to launch with PDL, why) for `--enable-pdl` `asked` (None: decide), on a device
    where PDL is `supported` or not. The default is on wherever it is supported: decode steps
    are faster with it, also with cuBLAS matmuls between the Triton kernels (docs/tuning.md,
    "Programmatic dependent launch")."""
    if asked is not None:
        return asked, "--enable-pdl" if asked else "--no-enable-pdl"
    if not supported:
        return False, "default: needs a CUDA GPU of compute capability 9.0+"
    return True, "default: a GPU of compute capability 9.0+"


def set_pdl(enabled: bool) -> None:
    """Launch every replaylm Triton kernel with programmatic dependent launch (PDL, sm90+) from
    now on, or not. Process-wide: set once when the model loads, before any graph capture (a
    captured graph keeps the launches it recorded)."""
    global _pdl
    _pdl = enabled


def pdl_launch() -> dict[str, bool]:
    """The keywords every kernel launch adds: the kernel's `USE_PDL` constexpr and, when PDL is
    on, triton's `launch_pdl` (the launch may start before the previous kernel ends; the kernel's
    `wait_for_producers` keeps it correct)."""
    return {"USE_PDL": True, "launch_pdl": True} if _pdl else {"USE_PDL": False}


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as `[rows, width]` with unit column stride (a view where possible): how the kernels
    read their inputs."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


def cublas_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in `out_dtype`, written into `out` when given (see
    `converted`). A float32 result of a 2-D half-precision `x` on CUDA without bias comes from
    cuBLAS's own float32 output (`torch.mm`'s `out_dtype`): no rounding to x's dtype and no
    conversion pass (docs/tuning.md, "LM head above 16 rows")."""
    if out_dtype == torch.float32 != x.dtype and bias is None and x.dim() == 2 and x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=out_dtype, out=out)
    return converted(F.linear(x, weight, bias), out_dtype, out)


def converted(
    y: torch.Tensor, out_dtype: torch.dtype | None, out: torch.Tensor | None
) -> torch.Tensor:
    """`y` in `out_dtype` (None: as it is), written into `out` when given (one launch either
    way): how a matmul result computed elsewhere (F.linear) meets `linear`'s contract. `out`
    must have `y`'s shape (no broadcasting)."""
    if out is not None:
        if out.shape != y.shape:
            raise ValueError(f"out has shape {list(out.shape)}, the result {list(y.shape)}")
        return out.copy_(y)
    return y if out_dtype is None else y.to(out_dtype)


@contextlib.contextmanager
def _switch(name: str, value: bool) -> Iterator[None]:
    """Set the module flag `name` to `value` while active."""
    previous = globals()[name]
    globals()[name] = value
    try:
        yield
    finally:
        globals()[name] = previous


def native_only() -> contextlib.AbstractContextManager[None]:
    """Inside, every layer runs its native torch path (parity checks, bisecting a wrong output).
    Not thread-safe: it flips a process-wide switch."""
    return _switch("_native_only", True)


def kernels_in_compiled_code(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """While active (with `enabled`), torch.compile traces the fused kernels as opaque custom ops
    (`ops`) instead of the layers' torch code. Hold it around every call of a compiled function
    that was traced under it: Dynamo guards on the switch. Not thread-safe."""
    return _switch("_kernels_when_compiling", enabled)
