"""`tc_piecewise`: the forward compiled by torch.compile, split at attention, each piece graphed.

At `prepare` the model's forward is compiled once (`compilation/`: traced whole, split at the
attention custom op, each compute piece compiled for every token count). Each shape is then
captured as a breakable graph of the compiled forward: every compute piece becomes one CUDA-graph
segment, every attention call runs eagerly between them with the live batch's metadata. So, as
with `breakable`, one prefill bucket serves any mix of requests and the attention backend needs no
graph hooks. With the default options the pieces run the eager model's fused kernels (same
numbers) and Inductor fuses the rest; with `kernels="native"` Inductor fuses the layers' torch code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from replaylm.compilation.compile_model import (
    CompiledForward,
    TcPiecewiseOptions,
    compiled_forward,
    set_compile_cache_dir,
)
from replaylm.layers.attention.base import AttentionBackend
from replaylm.layers.attention.layer import Attention, attention_layers
from replaylm.layers.attention.ops import attention_context
from replaylm.model_executor.cuda_graph.backend.base import CaptureContext, ForwardFn
from replaylm.model_executor.cuda_graph.backend.breakable import BreakableCudaGraphBackend

if TYPE_CHECKING:
    from replaylm.model_executor.cuda_graph.config import GraphBackendOptions
    from replaylm.model_executor.forward_batch import ForwardBatch
    from replaylm.models.llama import LlamaForCausalLM


class TcPiecewiseCudaGraphBackend(BreakableCudaGraphBackend):
    mode = "tc_piecewise"
    # a shape's first run may recompile (Dynamo guards, Inductor's per-size code): never inside
    # a capture
    warm_up_every_shape = True

    def __init__(
        self, attn_backend: AttentionBackend, options: TcPiecewiseOptions, debug: bool = False
    ) -> None:
        super().__init__(attn_backend, debug)
        self.options = options
        self.compiled: CompiledForward | None = None  # set by prepare
        self._layers: list[Attention] = []

    @classmethod
    def from_options(
        cls, attn_backend: AttentionBackend, options: GraphBackendOptions
    ) -> TcPiecewiseCudaGraphBackend:
        """`--tc-piecewise-compiler` and `--tc-piecewise-kernels`; `--compile-cache-dir`, where
        the compiled artifacts are kept, is set process-wide here."""
        if options.compile_cache_dir:
            set_compile_cache_dir(options.compile_cache_dir)
        compile_options = TcPiecewiseOptions(options.compiler, options.kernels)
        return cls(attn_backend, compile_options, debug=options.debug)

    def prepare(self, context: CaptureContext) -> None:
        """Compile the forward (once per model: the other phase reuses it) on the largest
        shape's all-padding batch."""
        super().prepare(context)
        self._layers = attention_layers(context.model)
        self.compiled = compiled_forward(context.model, self.options)
        if not self.compiled.is_compiled:
            batch = context.example_batch
            self.attn.init_forward_metadata(batch)
            with attention_context(batch, self._layers):
                self.compiled(batch.input_ids, batch.positions)

    def forward_hidden(self, model: LlamaForCausalLM, batch: ForwardBatch) -> torch.Tensor:
        assert self.compiled is not None, "prepare() first"
        return self.compiled(batch.input_ids, batch.positions)

    def capture_one(
        self, shape: int, batch: ForwardBatch, forward_fn: ForwardFn, first: bool
    ) -> None:
        with attention_context(batch, self._layers):
            super().capture_one(shape, batch, forward_fn, first)

    def replay(self, shape: int, batch: ForwardBatch) -> torch.Tensor:
        """Replayed segments call attention directly (no context needed); the debug switch runs
        the compiled forward itself, whose custom ops need the context."""
        if not self.debug:
            return super().replay(shape, batch)
        with attention_context(batch, self._layers):
            return super().replay(shape, batch)

    def stats(self) -> dict[str, Any]:
        seconds = self.compiled.compile_seconds if self.compiled is not None else None
        return {"compile_s": round(seconds, 2) if seconds is not None else None}
