"""The GPU's CUDA context, made on a thread while a scheduler process imports torch.

A scheduler process spends its first seconds importing torch and the model code, and only then
makes the device's CUDA context. torch's CUDA runtime runs on the device's *primary* context;
retaining that context through the driver API first does the same work in advance, and ctypes
releases the GIL around each driver call, so the thread runs beside the imports. When the runtime
initialises it finds the context made. Whatever fails here (no driver, no such device) is left for
torch to report as it would have.
"""

from __future__ import annotations

import ctypes
import threading


def cuda_device_index(device: str, tp_size: int, tp_rank: int, ranks_per_node: int) -> int | None:
    """The index of the GPU a scheduler process of `--device device` will run on (as
    ModelRunner picks it), or None when it runs on no GPU (`auto` on a machine without one
    finds no driver in `open_in_background`)."""
    if device != "auto" and not device.startswith("cuda"):
        return None
    if tp_size > 1:
        return tp_rank % ranks_per_node
    _, _, index = device.partition(":")
    return int(index) if index else 0


def open_in_background(index: int) -> threading.Thread:
    """Start retaining GPU `index`'s primary context on a daemon thread; returns the thread."""
    thread = threading.Thread(
        target=_retain_primary_context, args=(index,), name="cuda-context", daemon=True
    )
    thread.start()
    return thread


def _retain_primary_context(index: int) -> None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    device = ctypes.c_int()
    context = ctypes.c_void_p()
    if driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), index) == 0:
        driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
