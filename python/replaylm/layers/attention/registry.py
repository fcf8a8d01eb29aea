"""Attention backends by name (`--attention-backend`; `selection.py` resolves `auto`).

The table is plain data, so the launcher and the CUDA-graph resolver read a backend's traits
without importing torch; a backend's module is imported only when the backend is created, so
machines without triton (CPU) still work.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replaylm.layers.attention.base import AttentionBackend


@dataclass(frozen=True)
class AttentionBackendSpec:
    """Where a backend's class lives and what it offers (a test checks the traits against the
    class)."""

    module: str
    class_name: str
    gpu_only: bool = False  # refused off CUDA
    graph_hooks: bool = False  # implements CudaGraphAttentionBackend: usable in `full` graphs
    deterministic: bool = False  # has batch-invariant kernels; its class takes `deterministic`

    def load(self) -> type[AttentionBackend]:
        return getattr(importlib.import_module(self.module), self.class_name)


ATTENTION_BACKENDS: dict[str, AttentionBackendSpec] = {
    "torch_native": AttentionBackendSpec(
        "replaylm.layers.attention.torch_native", "TorchNativeAttnBackend"
    ),
    "triton": AttentionBackendSpec(
        "replaylm.layers.attention.triton",
        "TritonAttnBackend",
        gpu_only=True,
        graph_hooks=True,
        deterministic=True,
    ),
    "flashinfer": AttentionBackendSpec(
        "replaylm.layers.attention.flashinfer_backend",
        "FlashInferAttnBackend",
        gpu_only=True,
        graph_hooks=True,
    ),
}
GPU_ONLY_BACKENDS = frozenset(n for n, s in ATTENTION_BACKENDS.items() if s.gpu_only)
BACKENDS_WITH_GRAPH_HOOKS = frozenset(n for n, s in ATTENTION_BACKENDS.items() if s.graph_hooks)
DETERMINISTIC_BACKENDS = frozenset(n for n, s in ATTENTION_BACKENDS.items() if s.deterministic)


def supports_full_graph(backend: AttentionBackend) -> bool:
    """Whether a `full` CUDA graph may capture `backend`'s attention: the `graph_hooks` of the
    registry entry of the backend whose hooks it would call, the one place that says so (the
    CUDA-graph resolver reads the same entry by name, without importing the backend)."""
    spec = ATTENTION_BACKENDS.get(backend.full_graph_backend.name)
    return spec is not None and spec.graph_hooks


def check_deterministic(backend: str) -> None:
    """ValueError unless the resolved `backend` has batch-invariant kernels (`--deterministic`)."""
    if backend not in DETERMINISTIC_BACKENDS:
        raise ValueError(
            f"--deterministic needs the triton attention backend (batch-invariant "
            f"kernels, CUDA only); {backend} has none"
        )


def create_attention_backend(name: str, deterministic: bool = False) -> AttentionBackend:
    """Instantiate a backend by name; ValueError lists the known ones, says that the backend
    has no batch-invariant kernels when `deterministic` asks for them, or names the package its
    module could not import."""
    try:
        spec = ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend '{name}'; choose one of: {known}") from None
    if deterministic:
        check_deterministic(name)
    try:
        # constructors differ: a backend with batch-invariant kernels takes `deterministic`
        cls: Callable[..., AttentionBackend] = spec.load()
        return cls(deterministic) if spec.deterministic else cls()
    except ImportError as e:  # the module's imports, or the library a constructor imports
        raise ValueError(
            f"attention backend '{name}' cannot be imported ({e}); install what it needs or use "
            "another --attention-backend"
        ) from e


def create_phase_backends(
    decode: str, prefill: str, deterministic: bool = False
) -> AttentionBackend:
    """The backend of both phases (resolved names, `selection.py`'s), or a PerPhaseAttnBackend
    over two (`create_attention_backend` each)."""
    decode_backend = create_attention_backend(decode, deterministic)
    if prefill == decode:
        return decode_backend
    from replaylm.layers.attention.per_phase import PerPhaseAttnBackend

    return PerPhaseAttnBackend(decode_backend, create_attention_backend(prefill, deterministic))
