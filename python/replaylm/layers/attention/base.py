"""The attention-backend interface.

A backend computes attention over the paged KV pool in two calls per layer: `store_kv` writes this
step's K and V at the batch's KV slots, then `forward` attends from the pool (so new tokens see
themselves and their prefix) into an output buffer the caller allocated. The split lets a breakable
CUDA graph capture the store (its launch never depends on lengths) in the segment before the
attention break, and lets the break write straight into a static output, with no copy.
`init_forward_metadata` runs once per batch (before the layers) and prepares whatever every layer
shares (index tables, masks). Backends usable inside a `full` CUDA graph also implement the three
`*_cuda_graph` hooks of `CudaGraphAttentionBackend`.

An fp8 KV pool (`--kv-cache-dtype fp8_e4m3`) holds each layer's K / k_scale and V / v_scale
(`Attention`'s scales). Every backend attends over K and V as stored, a prefill's new tokens
too, so all of them compute the same thing; float8 converts exactly to the model's dtype, so
they fold k_scale into the softmax scale and v_scale into the output: one multiply per output
element, not one per cached element read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from replaylm.layers.attention.layer import Attention
    from replaylm.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Eager attention over the paged KV cache. q is `[T, H, D]`, k and v `[T, Hkv, D]`."""

    name: str

    @property
    def full_graph_backend(self) -> AttentionBackend:
        """The backend whose hooks a `full` CUDA graph would call (itself; a per-phase
        backend's decode backend). Whether it has them is its registry entry's `graph_hooks`
        (`registry.supports_full_graph`)."""
        return self

    def init_model(self, layers: Sequence[Attention], dtype: torch.dtype) -> None:
        """Called once the model is built, before any batch: its attention layers (by layer id)
        and dtype, for a backend that plans its kernels per model; ValueError naming
        `--attention-backend` for a model it cannot serve. Most backends need nothing."""
        return

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-batch state shared by all layers."""

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> None:
        """Write K/V of the new tokens at their KV slots. Must not sync with the host nor size a
        launch by anything but the token count (it is captured inside graph segments). An fp8
        cache stores them divided by the layer's `k_scale` / `v_scale`."""
        batch.kv.pool.store(layer.layer_id, batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)

    def kv_store_target(
        self, layer: Attention, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k cache, v cache, slots) where a fused kernel that produces K/V may store them itself
        instead of `store_kv` (exactly where and as `store_kv` would: same caches, same slots,
        the layer's scales for an fp8 cache, inside graph segments too); None when this backend
        stores them only through `store_kv`."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attend (K/V already stored by `store_kv`): writes `out` `[T, H, D]`, returns it."""
        if batch.forward_mode.is_decode_shaped():
            return self.forward_decode(q, k, v, layer, batch, out)
        return self.forward_extend(q, k, v, layer, batch, out)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over prefix + new tokens, into `out`."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One query token per request over its whole sequence, into `out`."""


class CudaGraphAttentionBackend(AttentionBackend):
    """A backend whose metadata can live in static buffers, as a `full` CUDA graph needs.

    Launch grids must not depend on values that change between replays (sequence lengths, request
    rows, KV slots): they are fixed at capture from the batch size alone. Padding requests (length
    0, or length 1 over the request table's zero padding row, writing KV slot 0) must be
    harmless: they may race on slot 0 and their outputs are undefined, but they touch no live
    slot. q/k/v come from the captured graph's own (static) tensors; the KV pool and the request
    table are static by construction; and the graph runner replays each shape with the very batch
    object it captured, whose tensors it refreshes in place, so the kernels may read the batch's
    own tensors (request rows, lengths, KV slots) with nothing copied.
    """

    @abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate, once, every buffer a captured graph reads beyond its batch's own tensors,
        for batches of up to `max_bs` requests and `max_num_tokens` tokens."""

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Point the kernels at static metadata for a capture of `batch`'s shape (the forward
        passes that follow are warm-up and capture)."""

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Refresh whatever static metadata is derived from `batch` (the very batch its graph
        captured, its tensors refreshed with any lengths) before that graph's replay."""
