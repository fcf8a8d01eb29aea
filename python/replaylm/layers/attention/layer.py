"""The attention layer a model calls; the computation is delegated to the batch's backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from replaylm.layers.attention.ops import attention_op

if TYPE_CHECKING:
    from replaylm.model_executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Paged attention for one layer. Inputs are `[T, H*D]` (q) and `[T, Hkv*D]` (k, v)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, layer_id: int
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        # an fp8 KV cache holds K / k_scale and V / v_scale (the checkpoint's scales, else 1.0);
        # a cache in the model's dtype holds K and V as they are, its scales left at 1.0
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        kv_stored: bool | torch.Tensor = False,
    ) -> torch.Tensor:
        """Store K/V (unless the caller's kernel stored them at the backend's `kv_store_target`:
        `kv_stored` True, or under torch.compile the storing op's result), then attend into a
        fresh output (inside a graph segment: a static buffer the attention break writes in
        place). Under torch.compile both calls are custom ops (tc_piecewise splits the graph at
        attention; `batch` is then unused: the ops read it from `attention_context`)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = q.new_empty(q.shape)
        if torch.compiler.is_compiling():
            stored = (
                kv_stored
                if isinstance(kv_stored, torch.Tensor)
                else torch.ops.replaylm.store_kv(k, v)
            )  # the next layer's: see ops.py
            torch.ops.replaylm.attention(q, k, v, out, stored, self.layer_id)
        else:
            if kv_stored is False:
                batch.attn_backend.store_kv(k, v, self, batch)
            attention_op(q, k, v, self, batch, out)
        return out.view(t, self.num_heads * self.head_dim)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers indexed by layer id (what `attention_context` needs)."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda layer: layer.layer_id
    )
    if [layer.layer_id for layer in layers] != list(range(len(layers))):
        raise ValueError("attention layer ids must be 0..n-1")
    return layers
