"""TritonAttnBackend: the default attention backend on CUDA, capturable in `full` CUDA graphs.

Per batch, `init_forward_metadata` only picks tensors the batch already has (no launch, no host
sync); the layers of an eager decode batch share one split-K workspace. In a `full` decode graph
the kernels read what they need per request or token (request rows, sequence lengths, KV slots of
the new tokens) from the captured batch's own tensors, which the graph runner refreshes in place,
so a replay copies nothing. The number of KV splits is a function of the batch size alone, so a
graph captured for a batch size serves any lengths, and eager and replayed decode of the same batch
compute exactly the same thing (a captured graph merges the KV slices in a launch of its own, eager
decode in the attention launch: the same numbers either way).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replaylm.layers.attention.base import CudaGraphAttentionBackend
from replaylm.layers.attention.triton.decode import (
    DecodeWorkspace,
    decode_attention,
    decode_workspace,
    longest_first,
    num_kv_splits,
    starts_longest_first,
)
from replaylm.layers.attention.triton.extend import extend_attention
from replaylm.layers.attention.triton.kv_store import store_kv

if TYPE_CHECKING:
    from replaylm.layers.attention.layer import Attention
    from replaylm.model_executor.forward_batch import ForwardBatch


@dataclass
class _DecodeMetadata:
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    out_cache_loc: torch.Tensor  # [bs] int64
    num_splits: int
    # eager batches: one split-K workspace for all layers, made by the first layer. Inside a
    # captured graph each layer allocates its partials (from the graph's pool) and counts
    # arrivals in this static buffer instead
    graph_arrivals: torch.Tensor | None = None
    workspace: DecodeWorkspace | None = None
    # captured graphs merge the slices in a launch of their own (`decode_attention`'s
    # `separate_merge`: no host cost there, the same numbers as the eager single launch)
    separate_merge: bool = False
    # a batch of more than two waves of programs (`starts_longest_first`) starts its requests
    # longest first, sorted by the forward's first layer (inside a captured graph: every replay)
    longest_first: bool = False
    order: torch.Tensor | None = None
    # a verify step's rows, taken this many at a time (`decode_attention`'s `rows_per_program`)
    rows_per_program: int = 1


@dataclass
class _ExtendMetadata:
    req_pool_indices: torch.Tensor  # [bs] int64
    prefix_lens: torch.Tensor  # [bs] int64
    extend_seq_lens: torch.Tensor  # [bs] int64
    extend_start_loc: torch.Tensor  # [bs] int64
    out_cache_loc: torch.Tensor  # [T] int64
    max_extend_len: int


@dataclass
class _MixedMetadata:
    """A mixed step: its first requests' decode tokens through the decode kernel, the prefill
    chunks after them through the extend kernel (the extend kernel's tile of query rows would
    be nearly all padding for a one-token request, its keys read once per query head)."""

    decode: _DecodeMetadata
    extend: _ExtendMetadata
    out_cache_loc: torch.Tensor  # [T] int64, every token's


@dataclass
class _GraphState:
    """What captured decode graphs read beyond their batches' own tensors."""

    max_bs: int
    arrivals: torch.Tensor | None = None  # [max_bs * KV heads] int32 zeros, made at first capture


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


DETERMINISTIC_SPLITS = 16  # decode slices per request whatever the batch (`deterministic`)
# a verify step's rows per decode program: four rows of a KV head's group of up to four query
# heads fill the kernel's smallest tile. Not under `deterministic`, where every row must be
# sliced as a decode step slices it
VERIFY_ROWS_PER_PROGRAM = 4


class TritonAttnBackend(CudaGraphAttentionBackend):
    """Paged attention through the Triton kernels of this package. `deterministic`: batch-invariant
    kernels (`--deterministic`): decode splits each request in DETERMINISTIC_SPLITS slices
    whatever the batch size, extend folds keys in tiles at fixed positions (`aligned`)."""

    name = "triton"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        self._meta: _DecodeMetadata | _ExtendMetadata | _MixedMetadata | None = None
        self._graph: _GraphState | None = None

    # ---- eager ------------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode_shaped():
            self._meta = self._decode_metadata(batch, batch.batch_size)
            return
        d = batch.num_decode
        extend = _ExtendMetadata(
            batch.req_pool_indices[d:],
            batch.prefix_lens[d:],
            batch.extend_seq_lens[d:],
            batch.extend_start_loc[d:],  # into the whole batch's tokens
            batch.out_cache_loc,
            max(batch.extend_seq_lens_cpu[d:], default=0),
        )
        self._meta = extend
        if d:
            self._meta = _MixedMetadata(
                self._decode_metadata(batch, d), extend, batch.out_cache_loc
            )

    def _decode_metadata(self, batch: ForwardBatch, bs: int) -> _DecodeMetadata:
        """Decode metadata of the batch's first `bs` requests (its first `bs` tokens)."""
        rows = self._rows_per_program(batch)
        num_splits = self._num_splits(bs, batch, rows)
        return _DecodeMetadata(
            batch.req_pool_indices[:bs],
            batch.seq_lens[:bs],
            batch.out_cache_loc[:bs],
            num_splits,
            longest_first=rows == 1 and self._longest_first(bs, num_splits, batch),
            rows_per_program=rows,
        )

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> None:
        """At the metadata's slots: the static copy inside a `full` graph."""
        pool = batch.kv.pool
        store_kv(
            pool.k_buffers[layer.layer_id],
            pool.v_buffers[layer.layer_id],
            self._metadata().out_cache_loc,
            k,
            v,
            layer.k_scale,
            layer.v_scale,
        )

    def kv_store_target(
        self, layer: Attention, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool = batch.kv.pool
        return (
            pool.k_buffers[layer.layer_id],
            pool.v_buffers[layer.layer_id],
            self._metadata().out_cache_loc,
        )

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        meta = self._metadata()
        if isinstance(meta, _MixedMetadata):
            d = batch.num_decode
            self._decode(q[:d], layer, batch, out[:d], meta.decode)
            meta = meta.extend
        assert isinstance(meta, _ExtendMetadata), "metadata was prepared for a decode batch"
        pool = batch.kv.pool
        return extend_attention(
            q,
            k,
            v,
            out,
            pool.k_buffers[layer.layer_id],
            pool.v_buffers[layer.layer_id],
            batch.kv.req_to_token.req_to_token,
            meta.req_pool_indices,
            meta.prefix_lens,
            meta.extend_seq_lens,
            meta.extend_start_loc,
            meta.max_extend_len,
            layer.scaling,
            aligned=self.deterministic,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
        )

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        meta = self._metadata()
        assert isinstance(meta, _DecodeMetadata), "metadata was prepared for an extend batch"
        return self._decode(q, layer, batch, out, meta)

    def _decode(
        self,
        q: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
        meta: _DecodeMetadata,
    ) -> torch.Tensor:
        pool = batch.kv.pool
        workspace = meta.workspace
        if workspace is None:
            workspace = decode_workspace(q, pool.num_kv_heads, meta.num_splits, meta.graph_arrivals)
            if meta.graph_arrivals is None:
                meta.workspace = workspace
        if meta.longest_first and layer.layer_id == 0:
            meta.order = longest_first(meta.seq_lens)
        return decode_attention(
            q,
            pool.k_buffers[layer.layer_id],
            pool.v_buffers[layer.layer_id],
            batch.kv.req_to_token.req_to_token,
            meta.req_pool_indices,
            meta.seq_lens,
            out,
            layer.scaling,
            meta.num_splits,
            workspace=workspace,
            separate_merge=meta.separate_merge,
            order=meta.order,
            rows_per_program=meta.rows_per_program,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
        )

    # ---- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Batches up to `max_bs` requests (the arrival counters are made at the first capture,
        which knows the KV heads)."""
        self._graph = _GraphState(max_bs)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Decode batches only: point the kernels at the batch's own tensors, with the number of
        KV splits fixed for this batch size."""
        graph = self._graph_state()
        if not batch.forward_mode.is_decode_shaped():
            raise ValueError("triton attention captures decode batches only")
        if graph.arrivals is None:
            graph.arrivals = torch.zeros(
                graph.max_bs * batch.kv.pool.num_kv_heads,
                dtype=torch.int32,
                device=batch.seq_lens.device,
            )
        rows = self._rows_per_program(batch)
        num_splits = self._num_splits(batch.batch_size, batch, rows)
        self._meta = _DecodeMetadata(
            batch.req_pool_indices,
            batch.seq_lens,
            batch.out_cache_loc,
            num_splits,
            graph_arrivals=graph.arrivals,
            separate_merge=True,
            longest_first=rows == 1 and self._longest_first(batch.batch_size, num_splits, batch),
            rows_per_program=rows,
        )

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Nothing to refresh: the kernels read the captured batch's own tensors."""

    # ---- helpers ----------------------------------------------------------------------------

    def _metadata(self) -> _DecodeMetadata | _ExtendMetadata | _MixedMetadata:
        if self._meta is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        return self._meta

    def _graph_state(self) -> _GraphState:
        if self._graph is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        return self._graph

    def _rows_per_program(self, batch: ForwardBatch) -> int:
        if batch.forward_mode.is_verify() and not self.deterministic:
            return VERIFY_ROWS_PER_PROGRAM
        return 1

    def _num_splits(self, bs: int, batch: ForwardBatch, rows_per_program: int = 1) -> int:
        """KV slices per request for `bs` decode rows of `batch`, taken `rows_per_program` at a
        time (so that many fewer programs attend)."""
        if self.deterministic:
            return DETERMINISTIC_SPLITS
        programs = -(-bs // rows_per_program)
        return num_kv_splits(programs, batch.kv.pool.num_kv_heads, _sm_count(batch.seq_lens.device))

    @staticmethod
    def _longest_first(bs: int, num_splits: int, batch: ForwardBatch) -> bool:
        """Whether `bs` decode requests of `batch` in `num_splits` slices start longest first."""
        return num_splits == 1 and starts_longest_first(
            bs, batch.kv.pool.num_kv_heads, _sm_count(batch.seq_lens.device)
        )
