"""PerPhaseAttnBackend: decode batches through one backend, prefill and mixed batches through
another (`--prefill-attention-backend`), each where it measures faster.

Both backends read and write the same KV pool and request table, so a request prefilled by one
decodes through the other. The `full` graph hooks are the decode backend's (only decode batches
are captured whole); a breakable or tc_piecewise prefill graph runs its backend's attention
eagerly between segments, as it does for a single backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from replaylm.layers.attention.base import AttentionBackend, CudaGraphAttentionBackend

if TYPE_CHECKING:
    from replaylm.layers.attention.layer import Attention
    from replaylm.model_executor.forward_batch import ForwardBatch


class PerPhaseAttnBackend(CudaGraphAttentionBackend):
    """See the module docstring. Its graph hooks are its decode backend's: the resolver and the
    full graph backend admit it only when that backend has them."""

    name = "per_phase"

    def __init__(self, decode: AttentionBackend, prefill: AttentionBackend) -> None:
        self.decode = decode
        self.prefill = prefill

    @property
    def full_graph_backend(self) -> AttentionBackend:
        return self.decode

    def _for(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.forward_mode.is_decode_shaped() else self.prefill

    def init_model(self, layers: Sequence[Attention], dtype: torch.dtype) -> None:
        self.decode.init_model(layers, dtype)
        self.prefill.init_model(layers, dtype)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._for(batch).init_forward_metadata(batch)

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> None:
        self._for(batch).store_kv(k, v, layer, batch)

    def kv_store_target(
        self, layer: Attention, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return self._for(batch).kv_store_target(layer, batch)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return self.prefill.forward_extend(q, k, v, layer, batch, out)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return self.decode.forward_decode(q, k, v, layer, batch, out)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_backend().init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._graph_backend().init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._graph_backend().init_forward_metadata_replay_cuda_graph(batch)

    def _graph_backend(self) -> CudaGraphAttentionBackend:
        # the full graph backend admits this backend only when its decode backend has hooks
        return cast(CudaGraphAttentionBackend, self.decode)
