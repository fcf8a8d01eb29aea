"""Reference attention backend: PyTorch SDPA over the paged KV cache. Runs on CPU and CUDA.

Per batch it builds one padded gather table `[B, Lk]` of KV slots and one boolean mask; per layer
it gathers K/V, runs one batched SDPA call with GQA, and scatters the valid rows back. No loop over
requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from replaylm.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from replaylm.layers.attention.layer import Attention
    from replaylm.model_executor.forward_batch import ForwardBatch


@dataclass
class _Metadata:
    kv_slots: torch.Tensor  # [B, Lk] int64 KV slot per key position (0 = padding slot)
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool, True = attend
    q_index: torch.Tensor  # [B, Lq] int64 flat token index of each query position
    q_valid: torch.Tensor  # [B, Lq] bool


class TorchNativeAttnBackend(AttentionBackend):
    """SDPA-based attention; exact reference for the other backends."""

    name = "torch_native"

    def __init__(self) -> None:
        self._meta: _Metadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        lk = max(batch.seq_lens_cpu, default=0)
        lq = max(batch.extend_seq_lens_cpu, default=0)
        rows = batch.kv.req_to_token.req_to_token[batch.req_pool_indices, :lk].to(torch.int64)
        kpos = torch.arange(lk, device=device)
        qpos = torch.arange(lq, device=device)
        key_valid = kpos[None, :] < batch.seq_lens[:, None]  # [B, Lk]
        q_valid = qpos[None, :] < batch.extend_seq_lens[:, None]  # [B, Lq]
        # query j of request b sits at absolute position prefix_len[b] + j: causal over keys <= it
        causal = kpos[None, None, :] <= (batch.prefix_lens[:, None, None] + qpos[None, :, None])
        mask = key_valid[:, None, :] & causal & q_valid[:, :, None]
        # padded query rows attend to key 0 only, so SDPA never sees an all-masked row (NaN)
        mask[:, :, 0] |= ~q_valid
        kv_slots = torch.where(key_valid, rows, torch.zeros_like(rows))
        q_index = (batch.extend_start_loc[:, None] + qpos[None, :]).clamp(max=batch.num_tokens - 1)
        self._meta = _Metadata(kv_slots, mask[:, None], q_index, q_valid)

    def _attend(
        self, q: torch.Tensor, layer: Attention, batch: ForwardBatch, out: torch.Tensor
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        k_cache = batch.kv.pool.k_buffers[layer.layer_id]
        v_cache = batch.kv.pool.v_buffers[layer.layer_id]
        k = k_cache[meta.kv_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, Lk, D]
        v = v_cache[meta.kv_slots].transpose(1, 2).to(q.dtype)
        qp = q[meta.q_index].transpose(1, 2)  # [B, H, Lq, D]
        attn = F.scaled_dot_product_attention(
            qp,
            k,
            v,
            attn_mask=meta.mask,
            scale=layer.scaling * layer.k_scale,  # an fp8 cache's scales, folded (base.py)
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        out.copy_(attn.transpose(1, 2)[meta.q_valid])  # [T, H, D], packed token order
        return out if layer.v_scale == 1.0 else out.mul_(layer.v_scale)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return self._attend(q, layer, batch, out)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return self._attend(q, layer, batch, out)
