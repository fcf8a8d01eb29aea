"""The attention call as the CUDA-graph backends see it.

`attention_op` is the plain call, marked as a break point: under a breakable CUDA graph it runs
eagerly between graph segments. `torch.ops.replaylm.attention` is the same call as an opaque
torch custom op, so that torch.compile (tc_piecewise) keeps it out of the traced graph and the
graph can be split there; a custom op takes only tensors and numbers, so it finds its batch and
layer through `attention_context`, which whoever runs the compiled forward must enter.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from replaylm.model_executor.cuda_graph.breakable_graph import break_point

if TYPE_CHECKING:
    from replaylm.layers.attention.layer import Attention
    from replaylm.model_executor.forward_batch import ForwardBatch

CUSTOM_OP_NAME = "replaylm::attention"

_context = threading.local()


@break_point
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
) -> torch.Tensor:
    """Store K/V and attend through the batch's backend: `[T, H, D]` q, `[T, Hkv, D]` k and v
    -> `[T, H, D]`."""
    return batch.attn_backend.forward(q, k, v, layer, batch)


@contextlib.contextmanager
def attention_context(batch: ForwardBatch, layers: Sequence[Attention]) -> Iterator[None]:
    """While open, `torch.ops.replaylm.attention(..., layer_id)` attends over `batch` with
    `layers[layer_id]` (the model's attention layers, indexed by layer id)."""
    previous = getattr(_context, "value", None)
    _context.value = (batch, layers)
    try:
        yield
    finally:
        _context.value = previous


@torch.library.custom_op(CUSTOM_OP_NAME, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    """`attention_op` for layer `layer_id` of the open `attention_context` (it also writes the
    layer's K/V cache, a side effect torch.compile does not see: nothing else in the graph reads
    that cache)."""
    current = getattr(_context, "value", None)
    if current is None:
        raise RuntimeError("torch.ops.replaylm.attention called outside attention_context()")
    batch, layers = current
    return attention_op(q, k, v, layers[layer_id], batch)


@attention.register_fake
def _attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
) -> torch.Tensor:
    return torch.empty_like(q)
