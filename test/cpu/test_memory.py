"""KV slot allocator, request-to-token table and KV pool."""

from __future__ import annotations

import pytest
import torch

from replaylm.mem_cache.errors import OutOfKVCacheError, OutOfRequestSlotsError
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool
from replaylm.mem_cache.token_allocator import TokenSlotAllocator


def test_allocator_hands_out_distinct_slots_and_never_the_padding_slot():
    alloc = TokenSlotAllocator(10)
    a, b = alloc.alloc(4), alloc.alloc(6)
    assert sorted(a + b) == list(range(1, 11))
    assert alloc.available_size() == 0


def test_allocator_exhaustion_is_reported_and_changes_nothing():
    alloc = TokenSlotAllocator(8)
    alloc.alloc(5)
    with pytest.raises(OutOfKVCacheError) as e:
        alloc.alloc(4)
    assert (e.value.need, e.value.available) == (4, 3)
    assert "need 4" in str(e.value) and "3 free" in str(e.value)
    assert alloc.available_size() == 3
    assert not alloc.can_alloc(4) and alloc.can_alloc(3)


def test_freed_slots_are_reused():
    alloc = TokenSlotAllocator(6)
    first = alloc.alloc(6)
    alloc.free(first[2:4])
    again = alloc.alloc(2)
    assert sorted(again) == sorted(first[2:4])
    with pytest.raises(ValueError, match="exceed the pool size"):
        alloc.free(list(range(1, 8)))


def test_request_table_rows_are_reused_and_exhaustion_reported():
    pool = ReqToTokenPool(2, 16, "cpu")
    r0, r1 = pool.alloc(2)
    assert {r0, r1} == {0, 1}
    with pytest.raises(OutOfRequestSlotsError):
        pool.alloc(1)
    w = pool.row_width
    pool.write(
        torch.tensor([r0 * w, r0 * w + 1, r0 * w + 2, r1 * w]),
        torch.tensor([5, 6, 7, 4], dtype=torch.int32),
    )
    pool.write(torch.tensor([r0 * w + 3]), torch.tensor([9], dtype=torch.int32))
    assert pool.slots(r0, 0, 4) == [5, 6, 7, 9] and pool.slots(r1, 0, 1) == [4]
    pool.free(r0)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(r0)
    assert pool.alloc(1) == [r0]
    pool.check_fits(16)
    with pytest.raises(ValueError, match="position 17 exceeds the context length 16"):
        pool.check_fits(17)


def test_kv_pool_stores_per_layer_at_slots():
    pool = KVPool(8, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([1, 5, 8])
    pool.store(1, slots, k, v)
    assert torch.equal(pool.k_buffers[1][slots], k) and torch.equal(pool.v_buffers[1][slots], v)
    assert pool.k_buffers[0].abs().sum() == 0
    assert pool.memory_bytes() == 2 * 2 * 9 * 2 * 4 * 4
    assert KVPool.bytes_per_token(2, 2, 4, torch.bfloat16) == 2 * 2 * 2 * 4 * 2
