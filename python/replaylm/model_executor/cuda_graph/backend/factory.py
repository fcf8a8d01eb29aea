"""(phase, mode, attention backend, server args) -> a graph backend instance, or a clear error.

One line per graph mode; what a mode can serve is its row in `config.MODE_TRAITS`, and the
options a backend takes it reads from the server args itself (`from_args`).
"""

from __future__ import annotations

from replaylm.layers.attention.base import AttentionBackend
from replaylm.model_executor.cuda_graph.backend.base import BaseCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.breakable import BreakableCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.full import FullCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.tc_piecewise import TcPiecewiseCudaGraphBackend
from replaylm.model_executor.cuda_graph.config import unsupported_reason
from replaylm.server_args import ServerArgs

GRAPH_BACKENDS: dict[str, type[BaseCudaGraphBackend]] = {
    "full": FullCudaGraphBackend,
    "breakable": BreakableCudaGraphBackend,
    "tc_piecewise": TcPiecewiseCudaGraphBackend,
}


def create_graph_backend(
    phase: str, mode: str, attn_backend: AttentionBackend, args: ServerArgs
) -> BaseCudaGraphBackend:
    """Raises ValueError for combinations no backend serves."""
    backend_cls = GRAPH_BACKENDS.get(mode)
    if backend_cls is None:
        raise ValueError(f"{phase}: no CUDA-graph backend for mode '{mode}'")
    why = unsupported_reason(phase, mode)
    if why is not None:
        raise ValueError(why)
    return backend_cls.from_args(attn_backend, args)
