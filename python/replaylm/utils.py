"""Small helpers shared across the package."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from replaylm.dtype_names import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu. Asking for cuda without a GPU is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """`auto` -> float32 on CPU; on a GPU the checkpoint's 16-bit dtype, else bfloat16."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype '{dtype}'; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if config_dtype == "float16" else torch.bfloat16


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set torch's default floating dtype (for allocation-at-construction)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def loading_threads(device: torch.device) -> Iterator[None]:
    """On the CPU, torch's ops on one thread for the duration: loading (dequantizing, copying,
    zero-filling fresh memory) is bound by memory and page faults, and where another process
    keeps a core busy, as the server's other process does at start-up, the threads of a
    parallel op spin waiting for each other. Nothing changes on other devices."""
    if device.type != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
