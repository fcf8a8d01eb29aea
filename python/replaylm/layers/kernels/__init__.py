"""Fused Triton kernels for a decoder layer's small ops: RMSNorm (+ residual add), per-head q/k
RMSNorm + rope, SiluAndMul; one launch each.

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

_HAS_TRITON = importlib.util.find_spec("triton") is not None
# The device type the kernels run on; the CPU tests set "cpu" to run the layers' Triton route in
# Triton's interpreter.
KERNEL_DEVICE_TYPE = "cuda"
_native_only = False
_kernels_when_compiling = False


def use_triton_kernels(x: torch.Tensor) -> bool:
    """True when a layer given `x` should run its fused Triton kernel: `x` is on CUDA
    (`KERNEL_DEVICE_TYPE`), triton is installed, no `native_only()` is active, and torch.compile
    is not tracing unless inside `kernels_in_compiled_code()`. Reads the device and flags only:
    no host sync."""
    return (
        x.device.type == KERNEL_DEVICE_TYPE and _HAS_TRITON and not _native_only
        and (_kernels_when_compiling or not torch.compiler.is_compiling())
    )


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as `[rows, width]` with unit column stride (a view where possible): how the kernels
    read their inputs."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


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
