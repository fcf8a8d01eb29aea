"""Paged KV pool, page size 1: one K and one V buffer per layer, indexed by token slot.

The buffers are in the model's dtype, or in float8 e4m3 (`--kv-cache-dtype fp8_e4m3`): then a
layer's K and V are held divided by its `k_scale` / `v_scale` and saturated at +-448, and every
reader multiplies them back (the attention backends fold the scales into the softmax scale and
the output)."""

from __future__ import annotations

import torch

from replaylm.layers.quantization.fp8 import FP8_DTYPE, to_fp8


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

    def store(
        self,
        layer_id: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write `k`, `v` (`[T, num_kv_heads, head_dim]`) into `slots` (`[T]`) of one layer, as
        `_cached` makes them with the layer's scales."""
        self.k_buffers[layer_id][slots] = self._cached(k, k_scale)
        self.v_buffers[layer_id][slots] = self._cached(v, v_scale)

    def _cached(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """`x` as the pool holds it: in float8 `x / scale` saturated at +-448 (as the Triton
        stores do), else `x` in the pool's dtype (whose scales are 1.0)."""
        if self.dtype == FP8_DTYPE:
            return to_fp8(x.float() / scale)
        return x.to(self.dtype)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots `src` into slots `dst` (int64 `[T]` each) in every layer."""
        for buf in self.k_buffers + self.v_buffers:
            raw = buf.view(torch.uint8)  # bytes: index_copy_ has no float8 kernel
            raw.index_copy_(0, dst, raw.index_select(0, src))

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)
