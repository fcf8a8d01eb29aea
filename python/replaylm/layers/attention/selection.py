"""Which attention backend a server uses, decided without importing torch (the CUDA-graph
resolver runs before any model or device is touched)."""

from __future__ import annotations

from replaylm.layers.attention.registry import GPU_ONLY_BACKENDS


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
