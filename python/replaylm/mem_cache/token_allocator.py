"""Free-list allocator of KV-cache token slots (page size 1).

Slot 0 is reserved as the padding slot: padded tokens write their K/V there, so it is never handed
out. Valid slots are 1..size.
"""

from __future__ import annotations

from collections.abc import Sequence

from replaylm.mem_cache.errors import OutOfKVCacheError


class TokenSlotAllocator:
    """Hands out and takes back KV slot indices. The free list lives on the host (a Python list
    used as a stack), so allocating launches nothing: the slots travel to the device inside the
    batch's one copy (ForwardBatch.create)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"KV pool size must be >= 1 token, got {size}")
        self.size = size
        self._free = list(range(size, 0, -1))  # popped from the end: low slots first

    def available_size(self) -> int:
        """Number of slots that can be allocated now."""
        return len(self._free)

    def can_alloc(self, need: int) -> bool:
        return need <= len(self._free)

    def alloc(self, need: int) -> list[int]:
        """Return `need` free slot indices; raises OutOfKVCacheError if too few are free."""
        if need > len(self._free):
            raise OutOfKVCacheError(need, len(self._free))
        start = len(self._free) - need
        out = self._free[start:]
        del self._free[start:]
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Return slots to the pool. Freeing more than was allocated raises ValueError."""
        if len(self._free) + len(slots) > self.size:
            raise ValueError(f"freeing {len(slots)} slots would exceed the pool size {self.size}")
        self._free.extend(slots)
