"""Free-list allocator of KV-cache token slots (page size 1).

Slot 0 is reserved as the padding slot: padded tokens write their K/V there, so it is never handed
out. Valid slots are 1..size.
"""

from __future__ import annotations

import torch

from replaylm.mem_cache.errors import OutOfKVCacheError


class TokenSlotAllocator:
    """Hands out and takes back KV slot indices; O(n) tensor ops, no per-slot Python loop."""

    def __init__(self, size: int, device: torch.device | str) -> None:
        if size < 1:
            raise ValueError(f"KV pool size must be >= 1 token, got {size}")
        self.size = size
        self.device = torch.device(device)
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=self.device)
        self._num_free = size

    def available_size(self) -> int:
        """Number of slots that can be allocated now."""
        return self._num_free

    def can_alloc(self, need: int) -> bool:
        return need <= self._num_free

    def alloc(self, need: int) -> torch.Tensor:
        """Return `need` free slot indices (int64); raises OutOfKVCacheError if too few are free."""
        if need > self._num_free:
            raise OutOfKVCacheError(need, self._num_free)
        start = self._num_free - need
        out = self._free[start : self._num_free].clone()
        self._num_free = start
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the pool. Freeing more than was allocated raises ValueError."""
        n = int(slots.numel())
        if n == 0:
            return
        if self._num_free + n > self.size:
            raise ValueError(f"freeing {n} slots would exceed the pool size {self.size}")
        self._free[self._num_free : self._num_free + n] = slots.to(self.device, torch.int64)
        self._num_free += n
