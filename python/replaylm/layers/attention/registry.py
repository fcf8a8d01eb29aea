"""Attention backends by name (`--attention-backend`).

`triton` is imported only when asked for, so machines without triton (CPU) still work.
"""

from __future__ import annotations

from collections.abc import Callable

from replaylm.layers.attention.base import AttentionBackend
from replaylm.layers.attention.torch_native import TorchNativeAttnBackend


def _triton() -> AttentionBackend:
    try:
        from replaylm.layers.attention.triton import TritonAttnBackend
    except ImportError as e:
        raise ValueError(
            f"attention backend 'triton' needs the triton package ({e}); install it or use "
            "--attention-backend torch_native"
        ) from e
    return TritonAttnBackend()


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch_native": TorchNativeAttnBackend,
    "triton": _triton,
}
GPU_ONLY_BACKENDS = frozenset({"triton"})


def resolve_attention_backend(name: str, device_type: str) -> str:
    """`auto` -> `triton` on CUDA, `torch_native` elsewhere; a GPU-only backend asked for off
    CUDA is a ValueError naming the flag."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch_native"
    if name in GPU_ONLY_BACKENDS and device_type != "cuda":
        raise ValueError(
            f"--attention-backend {name} needs a CUDA device; this server runs on {device_type} "
            "(use torch_native or auto)"
        )
    return name


def create_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a backend by name; ValueError lists the known ones."""
    try:
        factory = ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend '{name}'; choose one of: {known}") from None
    return factory()
