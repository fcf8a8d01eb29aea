"""`full`: the whole forward in one CUDA graph per shape, attention included.

Attention reads its metadata from static tensors: the graph runner replays each shape with the
batch it captured, its tensors refreshed in place, so the attention backend points the kernels
at that batch's own tensors at capture and a replay copies nothing. The attention backend must
support it (`registry.supports_full_graph`: its registry entry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from replaylm.layers.attention.base import AttentionBackend, CudaGraphAttentionBackend
from replaylm.layers.attention.registry import supports_full_graph
from replaylm.model_executor.cuda_graph.backend.base import (
    BaseCudaGraphBackend,
    CaptureContext,
    ForwardFn,
    warm_up,
)

if TYPE_CHECKING:
    from replaylm.model_executor.forward_batch import ForwardBatch


class FullCudaGraphBackend(BaseCudaGraphBackend):
    mode = "full"
    attn: CudaGraphAttentionBackend

    def __init__(self, attn_backend: AttentionBackend) -> None:
        if not supports_full_graph(attn_backend):
            raise ValueError(
                f"the full CUDA-graph backend needs an attention backend with CUDA-graph hooks; "
                f"'{attn_backend.name}' has none"
            )
        super().__init__(cast(CudaGraphAttentionBackend, attn_backend))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._context: CaptureContext | None = None

    def prepare(self, context: CaptureContext) -> None:
        self._context = context
        self.attn.init_cuda_graph_state(context.max_batch_size, context.max_num_tokens)

    def capture_one(
        self, shape: int, batch: ForwardBatch, forward_fn: ForwardFn, first: bool
    ) -> None:
        assert self._context is not None, "prepare() first"
        self.attn.init_forward_metadata_capture_cuda_graph(batch)
        stream = self._context.stream
        assert stream is not None  # a full graph is captured on CUDA, where the runner made one
        if self.warms_up(first):
            warm_up(stream, forward_fn, batch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._context.memory_pool, stream=stream):
            out = forward_fn(batch)
        self._graphs[shape] = (graph, out)

    def replay(self, shape: int, batch: ForwardBatch) -> torch.Tensor:
        graph, out = self._graphs[shape]
        self.attn.init_forward_metadata_replay_cuda_graph(batch)
        graph.replay()
        return out

    def cleanup(self) -> None:
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
