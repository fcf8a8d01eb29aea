"""The attention call as the CUDA-graph backends see it.

`attention_op` is the plain call, marked as a break point: under a breakable CUDA graph it runs
eagerly between graph segments (the K/V store before it does not: it is captured). The torch
custom ops `torch.ops.replaylm.store_kv` and `torch.ops.replaylm.attention` are the same two calls
as torch.compile (tc_piecewise) sees them: opaque, so the traced graph can be split at
`attention` (`store_kv` stays inside a compiled piece); a custom op takes only tensors and
numbers, so it finds its batch and layer through `attention_context`, which whoever runs the
compiled forward must enter, calling `start_forward` before each forward pass.

`store_kv` takes no layer id: it stores for the next layer in order (the context counts the
stores of the pass). So the compute pieces between two attention calls trace to identical graphs
for every layer, and Inductor compiles one and takes the others from its cache. `rope_store_kv`
is the other way to store, for compiled code that runs the fused kernels: the q/k norm + rope
kernel, storing K/V itself where the backend allows (`kv_store_target`), counted as a store.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from replaylm.layers.graph_break import break_point

if TYPE_CHECKING:
    from replaylm.layers.attention.layer import Attention
    from replaylm.model_executor.forward_batch import ForwardBatch

ATTENTION_OP_NAME = "replaylm::attention"
STORE_KV_OP_NAME = "replaylm::store_kv"
ROPE_STORE_KV_OP_NAME = "replaylm::rope_store_kv"

_context = threading.local()


@break_point
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: Attention,
    batch: ForwardBatch,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attend through the batch's backend (K/V already stored): `[T, H, D]` q, `[T, Hkv, D]` k
    and v; writes `out` `[T, H, D]` and returns it (under a breakable graph `out` is a static
    tensor of the previous segment, so the replayed op needs no copy)."""
    return batch.attn_backend.forward(q, k, v, layer, batch, out)


@contextlib.contextmanager
def attention_context(batch: ForwardBatch, layers: Sequence[Attention]) -> Iterator[None]:
    """While open, the custom ops below act on `batch` with `layers[layer_id]` (the model's
    attention layers, indexed by layer id)."""
    previous = getattr(_context, "value", None)
    _context.value = _Context(batch, layers)
    try:
        yield
    finally:
        _context.value = previous


class _Context:
    def __init__(self, batch: ForwardBatch, layers: Sequence[Attention]) -> None:
        self.batch = batch
        self.layers = layers
        self.stores = 0  # store_kv calls in this forward pass so far


def _current() -> _Context:
    current = getattr(_context, "value", None)
    if current is None:
        raise RuntimeError("replaylm attention ops called outside attention_context()")
    return current


def current_batch() -> ForwardBatch:
    """The batch of the open attention_context (for other ops that act on it under
    torch.compile, as the attention ops do)."""
    return _current().batch


def start_forward() -> None:
    """A forward pass begins in the open attention_context: its first store_kv is layer 0's.
    (Outside a context it does nothing; the ops raise there.)"""
    current = getattr(_context, "value", None)
    if current is not None:
        current.stores = 0


def _next_store(ctx: _Context) -> Attention:
    """The layer whose K/V the pass stores next (counted as stored)."""
    if ctx.stores >= len(ctx.layers):
        raise RuntimeError(
            "K/V stored more often than there are layers: a forward pass began "
            "without start_forward()"
        )
    layer = ctx.layers[ctx.stores]
    ctx.stores += 1
    return layer


@torch.library.custom_op(STORE_KV_OP_NAME, mutates_args=())
def store_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`store_kv` of the batch's backend for the next layer of the pass (one call per layer, in
    layer order). The K/V cache it writes is not an argument (torch.compile does not see the
    write), so it returns a dummy empty tensor that `attention` takes: the data dependency keeps
    the store alive and before the attention."""
    ctx = _current()
    ctx.batch.attn_backend.store_kv(k, v, _next_store(ctx), ctx.batch)
    return k.new_empty(0)


@store_kv.register_fake
def _store_kv_fake(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return k.new_empty(0)


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    layer: Attention,
    batch: ForwardBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.qk_norm_rope.qk_norm_rope` of `[T, H*D]` q and `[T, Hkv*D]` k (after the per-head
    norms `norm` = (q weight, k weight, eps)), and `layer`'s K/V store: inside the kernel where
    the batch's backend names a `kv_store_target`, else through its `store_kv`. Returns (q, k)."""
    from replaylm.layers.kernels import qk_norm_rope as rope

    backend = batch.attn_backend
    target = backend.kv_store_target(layer, batch)
    q, k = rope.qk_norm_rope(
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        head_dim,
        norm,
        kv_store=None if target is None else (v, *target),
        kv_scales=(layer.k_scale, layer.v_scale),
    )
    if target is None:
        t = k.shape[0]
        backend.store_kv(k.view(t, -1, head_dim), v.view(t, -1, head_dim), layer, batch)
    return q, k


@torch.library.custom_op(ROPE_STORE_KV_OP_NAME, mutates_args=())
def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm_rope_store` for the next layer of the pass, like `store_kv` (the norm when
    `q_weight` is given). Returns (q, k, `store_kv`'s dummy for `attention`)."""
    ctx = _current()
    norm = None
    if q_weight is not None:
        assert k_weight is not None  # the caller unpacks one (q, k, eps) norm: both or neither
        norm = (q_weight, k_weight, eps)
    q, k = norm_rope_store(
        q, k, v, positions, cos_cache, sin_cache, head_dim, norm, _next_store(ctx), ctx.batch
    )
    return q, k, k.new_empty(0)


@rope_store_kv.register_fake
def _rope_store_kv_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(0)


@torch.library.custom_op(ATTENTION_OP_NAME, mutates_args=("out",))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_stored: torch.Tensor,
    layer_id: int,
) -> None:
    """`attention_op` for layer `layer_id` of the open `attention_context`, into `out`;
    `kv_stored` is the result of the op that stored the layer's K/V (`store_kv`,
    `rope_store_kv`)."""
    ctx = _current()
    attention_op(q, k, v, ctx.layers[layer_id], ctx.batch, out)


@attention.register_fake
def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_stored: torch.Tensor,
    layer_id: int,
) -> None:
    return None
