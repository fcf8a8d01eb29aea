"""Attention backends by name (`--attention-backend`; `selection.py` resolves `auto`).

`triton` is imported only when asked for, so machines without triton (CPU) still work.
"""

from __future__ import annotations

from collections.abc import Callable

from replaylm.layers.attention.base import AttentionBackend
from replaylm.layers.attention.selection import check_deterministic
from replaylm.layers.attention.torch_native import TorchNativeAttnBackend


def _triton(deterministic: bool) -> AttentionBackend:
    try:
        from replaylm.layers.attention.triton import TritonAttnBackend
    except ImportError as e:
        raise ValueError(
            f"attention backend 'triton' needs the triton package ({e}); install it or use "
            "--attention-backend torch_native"
        ) from e
    return TritonAttnBackend(deterministic)


ATTENTION_BACKENDS: dict[str, Callable[[bool], AttentionBackend]] = {
    "torch_native": lambda deterministic: TorchNativeAttnBackend(),
    "triton": _triton,
}


def create_attention_backend(name: str, deterministic: bool = False) -> AttentionBackend:
    """Instantiate a backend by name; ValueError lists the known ones, or says that the backend
    has no batch-invariant kernels when `deterministic` asks for them."""
    try:
        factory = ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend '{name}'; choose one of: {known}") from None
    if deterministic:
        check_deterministic(name)
    return factory(deterministic)
