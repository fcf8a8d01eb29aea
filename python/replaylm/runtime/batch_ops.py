"""Turning requests into ForwardBatches: KV-slot allocation, request-table writes, release.

The scheduler forms every batch (and forks every `n > 1` request) through these functions, so KV
slots, request-table rows and each request's host copy of its slots (`Req.kv_slots`) always change
together. A request may come with slots already (a prefix found in the prefix cache): its new row
gets them written before its batch runs. Batches are for one runner, over its KV cache
(`runner.kv`), built where they will run; the memory-only functions take the
`KVCache` alone.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode
from replaylm.model_executor.packed_inputs import send_packed

if TYPE_CHECKING:
    from replaylm.mem_cache.kv_cache import KVCache
    from replaylm.model_executor.model_runner import ModelRunner
    from replaylm.runtime.request import Req


def prepare_extend(
    reqs: list[Req],
    runner: ModelRunner,
    chunk_sizes: list[int] | None = None,
    decoding: Sequence[Req] = (),
) -> ForwardBatch:
    """An EXTEND batch of each request's next `chunk_sizes[i]` uncached tokens (default: all),
    after one decode token of each `decoding` request (a mixed step; as `prepare_decode`, its
    last token, which the caller overwrites on the device when it is a step in flight's).

    Checks the lengths and allocates KV slots first, so ValueError or OutOfKVCacheError leaves
    every request untouched.
    """
    kv = runner.kv
    table = kv.req_to_token
    new_ids = [[r.last_id] for r in decoding]
    for req in decoding:
        table.check_fits(req.kv_len + 1)
    for i, req in enumerate(reqs):
        todo = req.id_slice(req.kv_len, req.num_ids)
        new_ids.append(todo if chunk_sizes is None else todo[: chunk_sizes[i]])
        table.check_fits(req.kv_len + len(new_ids[-1]))
    slots = kv.allocator.alloc(sum(len(t) for t in new_ids))
    rows_needed = [r for r in reqs if r.req_pool_idx is None]
    try:
        rows = table.alloc(len(rows_needed))
    except Exception:
        kv.allocator.free(slots)
        raise
    for req, row in zip(rows_needed, rows, strict=True):
        req.req_pool_idx = row
    prefixes = [(row, 0, r.kv_slots) for r, row in zip(rows_needed, rows, strict=True)]
    write_rows([span for span in prefixes if span[2]], kv)  # slots found in the prefix cache
    everyone = [*decoding, *reqs]
    prefix_lens = [req.kv_len for req in everyone]
    start = 0
    for req, ids in zip(everyone, new_ids, strict=True):
        req.kv_slots += slots[start : start + len(ids)]
        start += len(ids)
    return _create(
        ForwardMode.EXTEND, everyone, new_ids, prefix_lens, slots, runner, num_decode=len(decoding)
    )


def prepare_decode(reqs: list[Req], runner: ModelRunner) -> ForwardBatch:
    """A DECODE batch: each request's last token (the one not yet in the cache). Where a graph
    will replay it, it is built in that graph's inputs (`ModelRunner.build_batch`), so it stays
    valid until the next batch of that shape is prepared."""
    runner.kv.req_to_token.check_fits(max((r.kv_len for r in reqs), default=0) + 1)
    slots = runner.kv.allocator.alloc(len(reqs))
    prefix_lens = [r.kv_len for r in reqs]
    for req, slot in zip(reqs, slots, strict=True):
        req.kv_slots.append(slot)
    return _create(
        ForwardMode.DECODE, reqs, [[r.last_id] for r in reqs], prefix_lens, slots, runner
    )


def prepare_verify(reqs: list[Req], drafts: list[list[int]], runner: ModelRunner) -> ForwardBatch:
    """A TARGET_VERIFY batch: each request's last token then its draft tokens (perhaps none),
    after its cached prefix, one decode row per token (ForwardMode.TARGET_VERIFY): the row of
    the request's i-th token has the request's table row and a prefix of its KV length plus i.
    Every token gets a KV slot; `truncate_kv` gives back the slots of the drafts the target
    rejects."""
    table = runner.kv.req_to_token
    new_ids = [[r.last_id, *d] for r, d in zip(reqs, drafts, strict=True)]
    for req, ids in zip(reqs, new_ids, strict=True):
        table.check_fits(req.kv_len + len(ids))
    slots = runner.kv.allocator.alloc(sum(len(ids) for ids in new_ids))
    rows: list[int] = []
    prefix_lens: list[int] = []
    start = 0
    for req, ids in zip(reqs, new_ids, strict=True):
        assert req.req_pool_idx is not None  # a running request has its row
        rows += [req.req_pool_idx] * len(ids)
        prefix_lens += range(req.kv_len, req.kv_len + len(ids))
        req.kv_slots += slots[start : start + len(ids)]
        start += len(ids)
    token_rows = [[token] for ids in new_ids for token in ids]
    return runner.build_batch(ForwardMode.TARGET_VERIFY, token_rows, prefix_lens, rows, slots)


def truncate_kv(req: Req, length: int, kv: KVCache) -> None:
    """Keep the request's first `length` KV slots and free the rest (its own: the prefix
    cache's are never past its computed tokens). The request-table entries past `length` stay
    as they are: nothing reads past a request's length."""
    if req.kv_len > length:
        assert length >= req.shared_len
        kv.allocator.free(req.kv_slots[length:])
        del req.kv_slots[length:]


def fork(parent: Req, children: list[Req], kv: KVCache, share: bool = False) -> None:
    """Give each child its own request-table row holding the parent's cached prompt, so the
    children decode on from the parent's prefill without computing it again: the parent's own
    slots (`share`, for slots the prefix cache holds) or a device copy of its KV. Raises
    OutOfKVCacheError / OutOfRequestSlotsError with every request untouched."""
    n, table = parent.kv_len, kv.req_to_token
    if share:
        rows = table.alloc(len(children))
        write_rows([(row, 0, parent.kv_slots) for row in rows], kv)
        for child, row in zip(children, rows, strict=True):
            child.req_pool_idx = row
            child.kv_slots = list(parent.kv_slots)
        return
    slots = kv.allocator.alloc(n * len(children))
    try:
        rows = table.alloc(len(children))
    except Exception:
        kv.allocator.free(slots)
        raise
    index = [row * table.row_width + j for row in rows for j in range(n)]
    wide, dst32 = send_packed(table.device, parent.kv_slots * len(children) + slots + index, slots)
    src, dst, table_index = wide.split(len(slots))
    kv.pool.copy(src, dst)
    table.write(table_index, dst32)
    for i, (child, row) in enumerate(zip(children, rows, strict=True)):
        child.req_pool_idx = row
        child.kv_slots = slots[i * n : (i + 1) * n]


def write_rows(spans: list[tuple[int, int, list[int]]], kv: KVCache) -> None:
    """Record each (row, start, slots): `slots` at positions start.. of request-table row `row`,
    in one host-to-device copy. Only each span's first entry and length cross from the host: the
    table index of every slot is expanded on the device (a cached prefix is thousands of slots
    per request, too many to index one by one in Python)."""
    spans = [span for span in spans if span[2]]
    if not spans:
        return
    table = kv.req_to_token
    firsts = [row * table.row_width + start for row, start, _ in spans]
    lengths = [len(s) for _, _, s in spans]
    slots = array("i")
    for _, _, s in spans:
        slots.extend(s)
    wide, narrow = send_packed(table.device, firsts + lengths, slots)
    first, length = wide.split(len(spans))
    total = len(slots)
    # entry of slot k of span i: first[i] + (k - offset[i]), offset[i] = the lengths before i
    offsets = torch.cumsum(length, 0) - length
    shift = (first - offsets).repeat_interleave(length, output_size=total)
    index = torch.arange(total, device=table.device) + shift
    table.write(index, narrow)


def release(req: Req, kv: KVCache) -> None:
    """Free the request's own KV slots (those past `shared_len`: the prefix cache's stay) and
    its request-table row (host bookkeeping only: a step in flight may still write them; later
    steps reuse them in stream order)."""
    if req.req_pool_idx is None:
        return
    kv.allocator.free(req.kv_slots[req.shared_len :])
    kv.req_to_token.free(req.req_pool_idx)
    req.req_pool_idx = None
    req.kv_slots = []
    req.shared_len = 0


def _create(
    mode: ForwardMode,
    reqs: list[Req],
    new_ids: list[list[int]],
    prefix_lens: list[int],
    slots: list[int],
    runner: ModelRunner,
    num_decode: int = 0,
) -> ForwardBatch:
    """The batch; ForwardBatch.create also records each new token's slot in the request table
    (at its request's row and its position), from the batch's one host-to-device copy."""
    rows = [r.req_pool_idx for r in reqs if r.req_pool_idx is not None]
    assert len(rows) == len(reqs)  # prepare_extend gave each a row; decoding ones keep theirs
    return runner.build_batch(mode, new_ids, prefix_lens, rows, slots, num_decode)
