"""(phase, mode, attention backend) -> a graph backend instance, or a clear error."""

from __future__ import annotations

from replaylm.layers.attention.base import AttentionBackend
from replaylm.model_executor.cuda_graph.backend.base import BaseCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.breakable import BreakableCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.full import FullCudaGraphBackend

NOT_IMPLEMENTED = {
    "tc_piecewise": "the tc_piecewise CUDA-graph backend is not implemented yet",
}


def create_graph_backend(
    phase: str, mode: str, attn_backend: AttentionBackend, debug: bool = False
) -> BaseCudaGraphBackend:
    """Raises NotImplementedError for modes whose backend has not landed, ValueError for
    combinations no backend serves. `debug`: capture nothing, run eagerly through the graph
    path (breakable only)."""
    if mode in NOT_IMPLEMENTED:
        raise NotImplementedError(
            f"{phase}: {NOT_IMPLEMENTED[mode]}; use 'full', 'breakable' or 'disabled'"
        )
    if mode == "breakable":
        return BreakableCudaGraphBackend(attn_backend, debug)
    if mode == "full":
        if phase == "prefill":
            raise ValueError("prefill: mode 'full' is not supported; use 'breakable' or "
                             "'tc_piecewise'")
        return FullCudaGraphBackend(attn_backend)
    raise ValueError(f"{phase}: no CUDA-graph backend for mode '{mode}'")
