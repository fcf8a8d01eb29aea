"""Which CUDA GPUs this process can use, and how much memory the first has, found without
importing torch (the HTTP front end resolves the engine's settings before the model process
starts, and importing torch would cost its start seconds): through the CUDA driver's API, which
makes no context. Where torch is imported already (the offline Engine) its answer is taken, so
a CPU build of torch on a machine with a GPU runs on the CPU.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFacts:
    count: int
    memory_bytes: int  # of GPU 0


def probe_gpus() -> GpuFacts | None:
    """The GPUs (None: no driver, or no GPU visible)."""
    if "torch" in sys.modules:
        import torch

        if not torch.cuda.is_available():
            return None
        return GpuFacts(torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory)
    return _probe_driver()


def _probe_driver() -> GpuFacts | None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, device, memory = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    if count.value < 1 or driver.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return None
    if driver.cuDeviceTotalMem_v2(ctypes.byref(memory), device) != 0:
        return None
    return GpuFacts(count.value, memory.value)
