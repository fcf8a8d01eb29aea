"""Attention backends by name (`--attention-backend`)."""

from __future__ import annotations

from collections.abc import Callable

from replaylm.layers.attention.base import AttentionBackend
from replaylm.layers.attention.torch_native import TorchNativeAttnBackend

ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch_native": TorchNativeAttnBackend,
}


def create_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a backend by name; ValueError lists the known ones."""
    try:
        factory = ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend '{name}'; choose one of: {known}") from None
    return factory()
