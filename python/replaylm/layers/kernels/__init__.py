"""Fused Triton kernels for a decoder layer's small ops: RMSNorm (+ residual add), per-head q/k
RMSNorm + rope, SiluAndMul; one launch each.

Importing this package does not import triton (triton is optional); its kernel modules do, so the
layers import them only on the route `use_triton_kernels` picks. The layers' torch code stays the
native path: it runs on the CPU, inside `native_only()`, and under torch.compile, where Inductor
fuses the traced torch ops itself.
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


def use_triton_kernels(x: torch.Tensor) -> bool:
    """True when a layer given `x` should run its fused Triton kernel: `x` is on CUDA
    (`KERNEL_DEVICE_TYPE`), triton is installed, torch.compile is not tracing, and no
    `native_only()` is active. Reads the device and flags only: no host sync."""
    return (
        x.device.type == KERNEL_DEVICE_TYPE and not torch.compiler.is_compiling()
        and _HAS_TRITON and not _native_only
    )


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as `[rows, width]` with unit column stride (a view where possible): how the kernels
    read their inputs."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


@contextlib.contextmanager
def native_only() -> Iterator[None]:
    """Inside, every layer runs its native torch path (parity checks, bisecting a wrong output).
    Not thread-safe: it flips a process-wide switch."""
    global _native_only
    previous, _native_only = _native_only, True
    try:
        yield
    finally:
        _native_only = previous
