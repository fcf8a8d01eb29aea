"""runtime/batch_ops on the CPU with a tiny checkpoint: the request table written from the
batch's one copy, lengths checked before anything is allocated, slots and rows given back."""

from __future__ import annotations

import pytest

from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from model_parity import dummy_runner
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    write_tiny_checkpoint("qwen3", folder)
    return dummy_runner(
        folder / "config.json", "cpu", "float32", context_length=64, max_total_tokens=512
    )


def _req(rid: int, n: int) -> Req:
    return Req(rid, [10 + (rid * 7 + j) % 50 for j in range(n)], SamplingParams(), 0, 8)


def test_extend_then_decode_write_each_token_slot_at_its_row_and_position(runner):
    reqs = [_req(0, 5), _req(1, 2), _req(2, 9)]
    batch = prepare_extend(reqs, runner, chunk_sizes=[5, 2, 4])
    table = runner.kv.req_to_token
    slots, offset = batch.out_cache_loc.tolist(), 0
    for req, n in zip(reqs, [5, 2, 4], strict=True):
        assert table.slots(req.req_pool_idx, 0, n) == slots[offset : offset + n]
        offset += n
    batch = prepare_extend(reqs[2:], runner)  # the rest of the third prompt, after its prefix
    assert table.slots(reqs[2].req_pool_idx, 4, 9) == batch.out_cache_loc.tolist()
    assert batch.positions.tolist() == [4, 5, 6, 7, 8]
    for req in reqs:
        req.output_ids.append(3)
    batch = prepare_decode(reqs, runner)
    written = [table.slots(r.req_pool_idx, r.kv_len - 1, r.kv_len)[0] for r in reqs]
    assert written == batch.out_cache_loc.tolist()
    for req in reqs:
        release(req, runner.kv)


def test_a_prompt_longer_than_a_row_is_refused_before_anything_is_allocated(runner):
    free = (runner.kv.allocator.available_size(), runner.kv.req_to_token.available_size())
    reqs = [_req(0, 3), _req(1, 65)]
    with pytest.raises(ValueError, match="position 65 exceeds the context length 64"):
        prepare_extend(reqs, runner)
    assert all(r.kv_len == 0 and r.req_pool_idx is None for r in reqs)
    assert (
        runner.kv.allocator.available_size(),
        runner.kv.req_to_token.available_size(),
    ) == free
