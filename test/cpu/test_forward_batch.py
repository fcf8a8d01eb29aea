"""ForwardBatch.create: the index fields a forward reads, built on the host in one copy, and
the new tokens' slots recorded in the request table from it."""

from __future__ import annotations

import pytest
import torch

from replaylm.mem_cache.kv_cache import KVCache
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool
from replaylm.mem_cache.token_allocator import TokenSlotAllocator
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode
from replaylm.model_executor.packed_inputs import GraphInputs, send_packed


def _kv(table: ReqToTokenPool) -> KVCache:
    return KVCache(KVPool(256, 1, 1, 4, torch.float32, "cpu"), TokenSlotAllocator(256), table)


def _create(
    mode: ForwardMode,
    new_ids: list[list[int]],
    prefix: list[int],
    rows: list[int],
    table: ReqToTokenPool | None = None,
):
    slots = list(range(100, 100 + sum(len(t) for t in new_ids)))
    table = table or ReqToTokenPool(8, 32, "cpu")
    return ForwardBatch.create(mode, new_ids, prefix, rows, slots, _kv(table), None)


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


def test_create_records_each_new_token_slot_at_its_row_and_position():
    table = ReqToTokenPool(8, 16, "cpu")
    table.req_to_token.fill_(-1)
    _create(ForwardMode.EXTEND, [[5, 6, 7], [8], [9, 10]], [0, 4, 11], [3, 0, 7], table)
    assert table.slots(3, 0, 3) == [100, 101, 102]
    assert table.slots(0, 4, 5) == [103] and table.slots(7, 11, 13) == [104, 105]
    assert int((table.req_to_token != -1).sum()) == 6  # nothing else, no neighbouring row
    _create(ForwardMode.DECODE, [[42]], [13], [7], table)
    assert table.slots(7, 11, 14) == [104, 105, 100]


def test_a_token_past_the_row_is_refused_before_anything_is_written():
    table = ReqToTokenPool(8, 16, "cpu")
    with pytest.raises(ValueError, match="position 17 exceeds the context length 16"):
        _create(ForwardMode.EXTEND, [[1, 2]], [15], [0], table)
    assert int(table.req_to_token.count_nonzero()) == 0


def test_send_packed_keeps_both_widths():
    wide, narrow = send_packed(torch.device("cpu"), [2**40, -3, 7], [5, 2**31 - 1])
    assert wide.dtype == torch.int64 and wide.tolist() == [2**40, -3, 7]
    assert narrow.dtype == torch.int32 and narrow.tolist() == [5, 2**31 - 1]


def test_decode_fields_share_one_transfer():
    """Every host-built field is a view of one tensor: one host-to-device copy per batch."""
    batch = _create(ForwardMode.DECODE, [[42], [43]], [17, 3], [1, 2])
    assert batch.positions.tolist() == [17, 3] == batch.prefix_lens.tolist()
    assert batch.seq_lens.tolist() == [18, 4] and batch.extend_start_loc.tolist() == [0, 1]
    fields = (
        batch.input_ids,
        batch.positions,
        batch.seq_lens,
        batch.prefix_lens,
        batch.extend_seq_lens,
        batch.extend_start_loc,
        batch.req_pool_indices,
    )
    assert len({t.untyped_storage().data_ptr() for t in fields}) == 1


def test_an_empty_batch_has_empty_fields():
    batch = _create(ForwardMode.IDLE, [], [], [])
    assert batch.batch_size == 0 and batch.num_tokens == 0
    assert batch.positions.numel() == batch.seq_lens.numel() == 0


def test_a_decode_batch_built_in_graph_inputs_is_padded_there():
    """`create(into=...)`: the live requests' fields and table entries as without it, then
    padding requests (token 0 at position 0 of the padding row, KV slot 0, length 1) up to the
    inputs' size; the batch views the live part, and the padding row stays all zeros."""
    table = ReqToTokenPool(8, 16, "cpu")
    into = GraphInputs(4, 4, 1, table.padding_row, torch.device("cpu"))
    batch = ForwardBatch.create(
        ForwardMode.DECODE,
        [[42], [43]],
        [5, 9],
        [3, 6],
        [100, 101],
        _kv(table),
        None,
        into=into,
    )
    assert batch.batch_size == 2 and batch.seq_lens_cpu == [6, 10]
    assert into.holds(batch.input_ids) and batch.input_ids is into.views(2, 2)[0]
    assert table.slots(3, 5, 6) == [100] and table.slots(6, 9, 10) == [101]
    assert not table.req_to_token[table.padding_row].any()
    values = {
        name: into.field(name).tolist()
        for name in (
            "input_ids",
            "positions",
            "out_cache_loc",
            "req_pool_indices",
            "seq_lens",
            "prefix_lens",
            "extend_seq_lens",
            "extend_start_loc",
        )
    }
    pad = table.padding_row
    assert values == {
        "input_ids": [42, 43, 0, 0],
        "positions": [5, 9, 0, 0],
        "out_cache_loc": [100, 101, 0, 0],
        "req_pool_indices": [3, 6, pad, pad],
        "seq_lens": [6, 10, 1, 1],
        "prefix_lens": [5, 9, 0, 0],
        "extend_seq_lens": [1] * 4,
        "extend_start_loc": [0, 1, 2, 3],
    }
    assert into.slots32.tolist() == [100, 101, 0, 0]
    with pytest.raises(ValueError, match="graph inputs of 4 tokens cannot hold 5"):
        ForwardBatch.create(
            ForwardMode.DECODE,
            [[1]] * 5,
            [0] * 5,
            [0] * 5,
            [7] * 5,
            _kv(table),
            None,
            into=into,
        )


def test_an_extend_batch_built_in_graph_inputs_pads_by_span():
    """A prefill bucket's inputs: the live tokens, then padding requests of at most the span
    each (positions from 0), every request field at a fixed address whatever the count."""
    table = ReqToTokenPool(8, 16, "cpu")
    into = GraphInputs(12, 6, 4, table.padding_row, torch.device("cpu"))
    rows_before = into.field("req_pool_indices").data_ptr()
    batch = ForwardBatch.create(
        ForwardMode.EXTEND,
        [[5, 6, 7], [8]],
        [0, 2],
        [1, 2],
        [10, 11, 12, 13],
        _kv(table),
        None,
        into=into,
    )
    assert batch.num_tokens == 4 and batch.batch_size == 2
    assert into.padding_sizes(4) == [4, 4]
    pad = table.padding_row
    assert into.field("positions").tolist() == [0, 1, 2, 2, 0, 1, 2, 3, 0, 1, 2, 3]
    assert into.field("req_pool_indices").tolist() == [1, 2, pad, pad, 0, 0]
    assert into.field("extend_start_loc").tolist()[:4] == [0, 3, 4, 8]
    assert into.field("seq_lens").tolist()[:4] == [3, 3, 4, 4]
    assert into.field("req_pool_indices").data_ptr() == rows_before
    assert not table.req_to_token[pad].any()
