"""BaseCudaGraphBackend: how one shape of a phase is captured and replayed.

A backend never knows which phase it serves nor which runner drives it: the runner hands it a
`CaptureContext` once, then a shape key, a ForwardBatch whose tensors are views of the runner's
static buffers, and a `forward_fn(batch) -> logits` to capture. Call order: `from_options(...)`
(the factory), `prepare(context)` once; inside `capture_session()`, `capture_one(...)` per shape
(largest first, `first` true for the first); then per step `can_run(batch)` and, inside
`runtime_session()`, `replay(shape, batch)`; `cleanup()` frees every graph. `stats()` reports
what the backend itself spent (ModelRunner.cuda_graph_stats).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from replaylm.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from replaylm.model_executor.cuda_graph.config import GraphBackendOptions
    from replaylm.model_executor.forward_batch import ForwardBatch
    from replaylm.models.llama import LlamaForCausalLM

ForwardFn = Callable[["ForwardBatch"], torch.Tensor]
_NO_SESSION = contextlib.nullcontext()


def warm_up(stream: torch.cuda.Stream, forward_fn: ForwardFn, batch: ForwardBatch) -> None:
    """Run `forward_fn(batch)` eagerly once on the capture stream (lazy initialisation, kernel
    compilation and allocator growth happen here, outside any capture)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward_fn(batch)
    torch.cuda.current_stream().wait_stream(stream)


@dataclass(frozen=True)
class CaptureContext:
    """What a backend sees of the runner that captures with it."""

    model: LlamaForCausalLM
    memory_pool: Any  # the graph pool every graph of the phase shares (None off CUDA)
    stream: torch.cuda.Stream | None  # the capture stream (None off CUDA)
    max_batch_size: int  # requests of the largest padded batch
    max_num_tokens: int  # tokens of the largest padded batch
    example_batch: ForwardBatch  # the largest shape's all-padding batch


class BaseCudaGraphBackend(ABC):
    mode: str  # its row in `config.MODE_TRAITS`
    # Whether every shape runs its forward eagerly before its capture. Else only a phase's first
    # shape does (lazy initialisation); later shapes capture at once, a Triton variant they need
    # compiled or loaded inside the capture (legal: host work), which halves a start's capture.
    warm_up_every_shape = False

    def __init__(self, attn_backend: AttentionBackend) -> None:
        self.attn = attn_backend

    @classmethod
    def from_options(
        cls, attn_backend: AttentionBackend, options: GraphBackendOptions
    ) -> BaseCudaGraphBackend:
        """The backend for the resolved `options` (those it reads are its own)."""
        return cls(attn_backend)

    @abstractmethod
    def prepare(self, context: CaptureContext) -> None:
        """Once before capture: keep `context` and size whatever the captured shapes share
        (e.g. attention metadata buffers for the largest shape)."""

    @contextlib.contextmanager
    def capture_session(self) -> Iterator[None]:
        """Context around the whole capture loop."""
        yield

    @abstractmethod
    def capture_one(
        self, shape: int, batch: ForwardBatch, forward_fn: ForwardFn, first: bool
    ) -> None:
        """Capture `forward_fn(batch)` for `shape` into the runner's memory pool (`first`: the
        phase's first shape, warmed up eagerly before its capture)."""

    def warms_up(self, first: bool) -> bool:
        """Whether a shape's capture runs its forward eagerly first."""
        return first or self.warm_up_every_shape

    @abstractmethod
    def replay(self, shape: int, batch: ForwardBatch) -> torch.Tensor:
        """Run the graph of `shape` on `batch` (static buffers already filled, padding
        included); returns the output of the padded batch."""

    def forward_hidden(self, model: LlamaForCausalLM, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states `[T, H]` of `batch`'s tokens, as this backend computes them
        (the part of the forward a backend may transform: tc_piecewise compiles it)."""
        return model.forward_hidden(batch.input_ids, batch.positions, batch)

    def runtime_session(self) -> contextlib.AbstractContextManager[None]:
        """Context around each replay (none by default: a reusable null context, not a
        generator's, whose creation would cost every step's host a few us)."""
        return _NO_SESSION

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether this backend can replay `batch` (the runner already checked its shape)."""
        return True

    @abstractmethod
    def cleanup(self) -> None:
        """Free every captured graph and the outputs they own."""

    def stats(self) -> dict[str, Any]:
        """What this backend spent beyond capturing: `compile_s`, the seconds its forward took
        to compile (None: it compiles nothing)."""
        return {"compile_s": None}
