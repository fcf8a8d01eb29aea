"""BaseCudaGraphRunner: the backend-agnostic half of CUDA-graph execution for one phase.

It owns the shapes to capture, the memory pool that every graph of the phase shares, and the capture
loop (largest shape first, gc frozen, progress bar, time and memory logged), and each shape's
static inputs (`GraphInputs`), where the scheduler builds the batches the shape will replay
(`inputs_for`). At run time it pads a live batch up to the next captured shape (padding requests
use the request table's zero padding row and KV slot 0, so they read and write nothing live), asks
its backend to replay, and slices the output back to the live batch. Subclasses say what a shape
key is, how many requests a shape holds and how long a padding request may be, and what is
captured.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from replaylm.distributed.parallel_state import shows_progress
from replaylm.model_executor.cuda_graph.backend.base import BaseCudaGraphBackend, CaptureContext
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode
from replaylm.model_executor.packed_inputs import BATCH_FIELDS, GraphInputs

if TYPE_CHECKING:
    from replaylm.layers.attention.base import AttentionBackend
    from replaylm.mem_cache.kv_cache import KVCache
    from replaylm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """No garbage collection during capture (a collection could free tensors a graph uses,
    and walking the heap per shape is slow): freeze, unfreeze after. No collection first: a
    full one walks a whole server's heap, and garbage frozen is collected after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _settled_free_memory(device: torch.device) -> int:
    """Free CUDA memory after finishing queued work and returning cached blocks (so a
    difference of two readings counts what was kept); 0 off CUDA. Tensors die by reference
    count here, so no garbage collection (a walk of the server's heap each)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


@dataclass(frozen=True)
class RunnerContext:
    """What a graph runner sees of the model it captures."""

    model: LlamaForCausalLM
    kv: KVCache
    attn_backend: AttentionBackend


class BaseCudaGraphRunner(ABC):
    phase: str
    mode: ForwardMode  # of the batches it replays
    shape_unit: str  # what a shape counts, for messages
    max_shape_flag: str  # the flag that caps this phase's shapes

    def __init__(
        self, context: RunnerContext, backend: BaseCudaGraphBackend, shapes: Sequence[int]
    ) -> None:
        if not shapes:
            raise ValueError(f"{self.phase} graph runner needs at least one shape")
        self.context = context
        self.device = context.kv.device
        self.backend = backend
        self.shapes = tuple(sorted(set(shapes)))
        self.padding_row = context.kv.req_to_token.padding_row
        self.inputs = {
            shape: GraphInputs(
                self.shape_tokens(shape),
                self.shape_requests(shape),
                self.padding_span,
                self.padding_row,
                self.device,
            )
            for shape in self.shapes
        }
        # graph pool handle (torch types it privately): owned for as long as graphs may be captured
        self.memory_pool: Any = None
        self.capture_stream: torch.cuda.Stream | None = None
        self.capture_seconds = 0.0  # of the last `capture`
        self.capture_bytes = 0  # CUDA memory its graphs kept
        self._padded: dict[int, ForwardBatch] = {}

    # ---- per phase --------------------------------------------------------------------------

    @property
    @abstractmethod
    def padding_span(self) -> int:
        """The most tokens one padding request takes."""

    @abstractmethod
    def shape_tokens(self, shape: int) -> int:
        """Tokens of a batch padded to `shape`."""

    @abstractmethod
    def shape_requests(self, shape: int) -> int:
        """The most requests, padding ones included, of a batch padded to `shape`."""

    @abstractmethod
    def shape_key(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> int | None:
        """The size a live batch is matched on (None: this phase does not serve the batch)."""

    @abstractmethod
    def forward_fn(self, batch: ForwardBatch) -> torch.Tensor:
        """What is captured for a shape (attention metadata comes from the backend)."""

    @abstractmethod
    def finish(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, V]` of the live `batch` from the padded shape's captured output."""

    # ---- shared -----------------------------------------------------------------------------

    def shape_for(self, key: int) -> int | None:
        """The smallest captured shape >= key, or None when key exceeds the largest."""
        i = bisect.bisect_left(self.shapes, key)
        return self.shapes[i] if i < len(self.shapes) else None

    def _shape_of(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> int | None:
        key = self.shape_key(mode, batch_size, num_tokens)
        return self.shape_for(key) if key is not None and key > 0 else None

    def can_run(self, batch: ForwardBatch) -> bool:
        shape = self._shape_of(batch.forward_mode, batch.batch_size, batch.num_tokens)
        return shape is not None and self.backend.can_run(batch)

    def inputs_for(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> GraphInputs | None:
        """Where a batch of this size is best built (`ForwardBatch.create`'s `into`): the inputs
        of the shape that will replay it, so the replay copies nothing; None where no shape
        serves it."""
        shape = self._shape_of(mode, batch_size, num_tokens)
        return self.inputs[shape] if shape is not None else None

    def fill(self, batch: ForwardBatch | None, shape: int) -> ForwardBatch:
        """`batch` in the static inputs of `shape` (copied in unless it was built there), padded
        to `shape`: the same ForwardBatch object for a shape every time (its fields updated in
        place), so ops captured with it see the current batch at replay. `batch=None` builds
        the all-padding batch used at capture."""
        inputs, kv = self.inputs[shape], self.context.kv
        if batch is None:
            batch = ForwardBatch.create(
                self.mode, [], [], [], [], kv, self.context.attn_backend, into=inputs
            )
        elif not inputs.holds(batch.input_ids):
            inputs.copy_in({name: getattr(batch, name) for name in BATCH_FIELDS})
        pad = inputs.padding_sizes(batch.num_tokens)
        seq_cpu = batch.seq_lens_cpu + pad
        ext_cpu = batch.extend_seq_lens_cpu + pad
        padded = self._padded.get(shape)
        if padded is not None and (padded.batch_size, padded.num_decode) == (
            len(seq_cpu),
            batch.num_decode,
        ):  # the same tensors (a decode shape's always): its host lengths only
            padded.seq_lens_cpu, padded.extend_seq_lens_cpu = seq_cpu, ext_cpu
            return padded
        fresh = ForwardBatch.from_fields(
            self.mode,
            inputs.views(inputs.num_tokens, len(seq_cpu)),
            seq_cpu,
            ext_cpu,
            kv,
            self.context.attn_backend,
            batch.num_decode,
        )
        if padded is None:
            self._padded[shape] = padded = fresh
        else:
            vars(padded).update(vars(fresh))
        return padded

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape, largest first, into one memory pool. On a device without CUDA
        graphs (only with an eager debug backend) the same loop runs with no pool or stream."""
        device = self.device
        if self.memory_pool is None and device.type == "cuda":
            self.memory_pool = torch.cuda.graph_pool_handle()
            self.capture_stream = torch.cuda.Stream(device)
        free_before = _settled_free_memory(device)
        self.backend.prepare(self.capture_context())  # not timed: tc_piecewise compiles here
        start = time.perf_counter()
        with frozen_gc(), self.backend.capture_session():
            shapes = sorted(self.shapes, reverse=True)
            desc = f"capturing {self.phase} CUDA graphs ({self.backend.mode})"
            bar = tqdm(shapes, desc=desc, unit="shape", disable=not shows_progress())
            for i, shape in enumerate(bar):
                try:
                    self.backend.capture_one(shape, self.fill(None, shape), self.forward_fn, i == 0)
                except torch.OutOfMemoryError as err:
                    raise self._out_of_memory(shape, free_before) from err
        free_after = _settled_free_memory(device)  # warm-up runs' cached blocks are not kept
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - free_after
        logger.info(
            "captured %d %s CUDA graphs (%s) in %.1f s, %.0f MiB of graph memory; shapes %s",
            len(shapes),
            self.phase,
            self.backend.mode,
            self.capture_seconds,
            self.capture_bytes / 2**20,
            list(self.shapes),
        )

    def _out_of_memory(self, shape: int, free_before: int) -> RuntimeError:
        """The error a user reads instead of torch's, after freeing the graphs captured so far
        (the process may go on without them: ModelRunner's caller decides)."""
        held = (free_before - _settled_free_memory(self.device)) / 2**30
        self.cleanup()
        return RuntimeError(
            f"GPU out of memory capturing the {self.phase} CUDA graph of {shape} "
            f"{self.shape_unit} (shapes up to {self.shapes[-1]}; graphs held {held:.1f} GiB "
            f"then): capture fewer or smaller shapes ({self.max_shape_flag}), lower "
            "--mem-fraction-static, or turn this phase's graphs off (--cuda-graph-mode)"
        )

    def capture_context(self) -> CaptureContext:
        """What the backend sees of this runner (`capture` makes the pool and stream first)."""
        largest = self.shapes[-1]
        return CaptureContext(
            model=self.context.model,
            memory_pool=self.memory_pool,
            stream=self.capture_stream,
            max_batch_size=self.shape_requests(largest),
            max_num_tokens=self.shape_tokens(largest),
            example_batch=self.fill(None, largest),
        )

    def stats(self) -> dict[str, Any]:
        """Mode, number of shapes, capture seconds, graph memory (MiB) and the backend's own
        stats (`compile_s`), after `capture`."""
        return {
            "mode": self.backend.mode,
            "shapes": len(self.shapes),
            "capture_s": round(self.capture_seconds, 2),
            "graph_mib": round(self.capture_bytes / 2**20, 1),
            **self.backend.stats(),
        }

    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, int]:
        """(logits of the live requests, padding tokens this replay computed), under inference
        mode (entered here unless the caller is in it already, as ModelRunner.forward is: this
        is host time that a step-by-step server's GPU waits through, a few us per context)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.replay(batch)
        shape = self._shape_of(batch.forward_mode, batch.batch_size, batch.num_tokens)
        if shape is None:
            raise ValueError(
                f"{self.phase} batch of {batch.batch_size} requests and {batch.num_tokens} "
                "tokens has no captured graph"
            )
        padded = self.fill(batch, shape)
        with self.backend.runtime_session():
            output = self.backend.replay(shape, padded)
        return self.finish(output, batch), padded.num_tokens - batch.num_tokens

    def cleanup(self) -> None:
        """Free every graph (the memory pool handle stays, for a later capture)."""
        self.backend.cleanup()
