"""(phase, mode, attention backend) -> a graph backend instance, or a clear error."""

from __future__ import annotations

from replaylm.compilation.compile_model import TcPiecewiseOptions
from replaylm.layers.attention.base import AttentionBackend
from replaylm.model_executor.cuda_graph.backend.base import BaseCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.breakable import BreakableCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.full import FullCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.tc_piecewise import TcPiecewiseCudaGraphBackend


def create_graph_backend(
    phase: str,
    mode: str,
    attn_backend: AttentionBackend,
    debug: bool = False,
    tc_options: TcPiecewiseOptions | None = None,
) -> BaseCudaGraphBackend:
    """Raises ValueError for combinations no backend serves. `debug`: capture nothing, run
    eagerly through the graph path (breakable and tc_piecewise); `tc_options`: how
    tc_piecewise compiles (default `TcPiecewiseOptions()`)."""
    if mode == "breakable":
        return BreakableCudaGraphBackend(attn_backend, debug)
    if mode == "tc_piecewise":
        return TcPiecewiseCudaGraphBackend(attn_backend, tc_options or TcPiecewiseOptions(), debug)
    if mode == "full":
        if phase == "prefill":
            raise ValueError(
                "prefill: mode 'full' is not supported; use 'breakable' or 'tc_piecewise'"
            )
        return FullCudaGraphBackend(attn_backend)
    raise ValueError(f"{phase}: no CUDA-graph backend for mode '{mode}'")
