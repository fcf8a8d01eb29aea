"""(phase, mode, attention backend, options) -> a graph backend instance, or a clear error.

One line per graph mode; what a mode can serve is its row in `MODE_TRAITS`, and the options a
backend takes it reads from the resolved `GraphBackendOptions` itself (`from_options`).
"""

from __future__ import annotations

from replaylm.cuda_graph_modes import unsupported_reason
from replaylm.layers.attention.base import AttentionBackend
from replaylm.model_executor.cuda_graph.backend.base import BaseCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.breakable import BreakableCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.full import FullCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.tc_piecewise import TcPiecewiseCudaGraphBackend
from replaylm.model_executor.cuda_graph.config import GraphBackendOptions

GRAPH_BACKENDS: dict[str, type[BaseCudaGraphBackend]] = {
    "full": FullCudaGraphBackend,
    "breakable": BreakableCudaGraphBackend,
    "tc_piecewise": TcPiecewiseCudaGraphBackend,
}


def create_graph_backend(
    phase: str, mode: str, attn_backend: AttentionBackend, options: GraphBackendOptions
) -> BaseCudaGraphBackend:
    """Raises ValueError for combinations no backend serves."""
    backend_cls = GRAPH_BACKENDS.get(mode)
    if backend_cls is None:
        raise ValueError(f"{phase}: no CUDA-graph backend for mode '{mode}'")
    why = unsupported_reason(phase, mode)
    if why is not None:
        raise ValueError(why)
    return backend_cls.from_options(attn_backend, options)
