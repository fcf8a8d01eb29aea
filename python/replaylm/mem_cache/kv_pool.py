"""Paged KV pool, page size 1: one K and one V buffer per layer, indexed by token slot."""

from __future__ import annotations

import torch


class KVPool:
    """`k_buffers[l]` and `v_buffers[l]` are `[size + 1, num_kv_heads, head_dim]`; row 0 is the
    padding slot (see TokenSlotAllocator)."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one token's K and V take over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` (`[T, num_kv_heads, head_dim]`) into `slots` (`[T]`) of one layer."""
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots `src` into slots `dst` (int64 `[T]` each) in every layer."""
        for buffers in (self.k_buffers, self.v_buffers):
            for buf in buffers:
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)
