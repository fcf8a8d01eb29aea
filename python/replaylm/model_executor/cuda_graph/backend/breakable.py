"""`breakable`: each shape is a chain of CUDA graphs broken at every attention call.

Attention runs eagerly between the segments with metadata built fresh for the live (padded)
batch, so one prefill shape serves any mix of requests whose new tokens fit the bucket, and the
attention backend needs no graph hooks. With `debug=True` nothing is captured and every replay
runs the forward eagerly through the same path (`--debug-cuda-graph`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from replaylm.layers.attention.base import AttentionBackend
from replaylm.model_executor.cuda_graph.backend.base import (
    BaseCudaGraphBackend,
    CaptureContext,
    ForwardFn,
    warm_up,
)
from replaylm.model_executor.cuda_graph.breakable_graph import BreakableCUDAGraph

if TYPE_CHECKING:
    from replaylm.model_executor.cuda_graph.config import GraphBackendOptions
    from replaylm.model_executor.forward_batch import ForwardBatch


class BreakableCudaGraphBackend(BaseCudaGraphBackend):
    mode = "breakable"

    def __init__(self, attn_backend: AttentionBackend, debug: bool = False) -> None:
        super().__init__(attn_backend)
        self.debug = debug
        self._graphs: dict[int, BreakableCUDAGraph] = {}
        self._context: CaptureContext | None = None

    @classmethod
    def from_options(
        cls, attn_backend: AttentionBackend, options: GraphBackendOptions
    ) -> BreakableCudaGraphBackend:
        return cls(attn_backend, debug=options.debug)

    def prepare(self, context: CaptureContext) -> None:
        self._context = context

    def capture_one(
        self, shape: int, batch: ForwardBatch, forward_fn: ForwardFn, first: bool
    ) -> None:
        assert self._context is not None, "prepare() first"
        self.attn.init_forward_metadata(batch)
        stream = self._context.stream
        if not self.debug and self.warms_up(first):  # debug: nothing captured, any device
            assert stream is not None  # capturing: on CUDA, where the runner made the stream
            warm_up(stream, forward_fn, batch)
        graph = BreakableCUDAGraph(self._context.memory_pool, stream, eager=self.debug)
        graph.capture(forward_fn, batch)
        self._graphs[shape] = graph

    def replay(self, shape: int, batch: ForwardBatch) -> torch.Tensor:
        self.attn.init_forward_metadata(batch)
        return self._graphs[shape].replay()

    def cleanup(self) -> None:
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
