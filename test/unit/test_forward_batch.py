"""ForwardBatch.create: the index fields a forward reads, built on the host in one copy."""

from __future__ import annotations

import torch

from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode


def _create(mode: ForwardMode, new_ids: list[list[int]], prefix: list[int], rows: list[int]):
    slots = torch.arange(100, 100 + sum(len(t) for t in new_ids))
    return ForwardBatch.create(mode, new_ids, prefix, rows, slots, None, None, None)


def test_extend_fields_of_a_ragged_batch():
    batch = _create(ForwardMode.EXTEND, [[5, 6, 7], [8], [9, 10]], [0, 4, 11], [3, 0, 7])
    assert batch.batch_size == 3 and batch.num_tokens == 6
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.positions.tolist() == [0, 1, 2, 4, 11, 12]
    assert batch.seq_lens.tolist() == [3, 5, 13] == batch.seq_lens_cpu
    assert batch.prefix_lens.tolist() == [0, 4, 11]
    assert batch.extend_seq_lens.tolist() == [3, 1, 2] == batch.extend_seq_lens_cpu
    assert batch.extend_start_loc.tolist() == [0, 3, 4]
    assert batch.req_pool_indices.tolist() == [3, 0, 7]
    assert batch.out_cache_loc.tolist() == list(range(100, 106))
    assert all(t.dtype == torch.int64 for t in (batch.input_ids, batch.positions, batch.seq_lens))


def test_decode_fields_share_one_transfer():
    """Every host-built field is a view of one tensor: one host-to-device copy per batch."""
    batch = _create(ForwardMode.DECODE, [[42], [43]], [17, 3], [1, 2])
    assert batch.positions.tolist() == [17, 3] == batch.prefix_lens.tolist()
    assert batch.seq_lens.tolist() == [18, 4] and batch.extend_start_loc.tolist() == [0, 1]
    fields = (batch.input_ids, batch.positions, batch.seq_lens, batch.prefix_lens,
              batch.extend_seq_lens, batch.extend_start_loc, batch.req_pool_indices)
    assert len({t.untyped_storage().data_ptr() for t in fields}) == 1


def test_an_empty_batch_has_empty_fields():
    batch = _create(ForwardMode.IDLE, [], [], [])
    assert batch.batch_size == 0 and batch.num_tokens == 0
    assert batch.positions.numel() == batch.seq_lens.numel() == 0
