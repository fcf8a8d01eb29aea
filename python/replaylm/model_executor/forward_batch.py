"""ForwardBatch: everything one forward pass of the model sees, as device tensors.

Tokens of all requests are packed along one flat token dimension (`T` = `num_tokens`): request `i`
owns tokens `extend_start_loc[i] : extend_start_loc[i] + extend_seq_lens[i]`. A graph runner later
copies these tensors into its static buffers, so every field a kernel reads is a tensor here; the
`*_cpu` lists are host copies for code that needs sizes without a device sync.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from replaylm.layers.attention.base import AttentionBackend
    from replaylm.mem_cache.kv_pool import KVPool
    from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool


class ForwardMode(Enum):
    """EXTEND: prefill or chunked prefill (new tokens after a cached prefix, possibly empty).
    DECODE: one new token per request. IDLE: no tokens (keeps the step loop uniform)."""

    EXTEND = auto()
    DECODE = auto()
    IDLE = auto()

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One step's inputs. Lengths are per request; `seq_lens` counts prefix + new tokens."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int64, tokens in the cache after this step
    prefix_lens: torch.Tensor  # [B] int64, tokens already in the cache before this step
    extend_seq_lens: torch.Tensor  # [B] int64, new tokens this step (1 in decode)
    extend_start_loc: torch.Tensor  # [B] int64, offset of each request's first new token
    req_pool_indices: torch.Tensor  # [B] int64, rows of the request-to-token table
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token writes
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    attn_backend: AttentionBackend

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def create(
        cls,
        forward_mode: ForwardMode,
        new_token_ids: list[list[int]],
        prefix_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: Sequence[int],
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
    ) -> ForwardBatch:
        """Pack per-request host lists into device tensors and record every new token's KV slot
        in the request table (`req_to_token_pool.write`), so the batch's attention can read it.

        Every value is computed in plain Python on the host and the lot crosses to the table's
        device in one copy (the fields are views of it), so building a batch launches one kernel
        (the table write) and never waits for the device: a step-by-step server pays this host
        time every step, and on a GPU host each torch call costs 5-15 us.

        `new_token_ids[i]` are request i's tokens for this step, at positions
        `prefix_lens[i] ..`; their KV slots are `out_cache_loc` in the same packed order.
        """
        ext_cpu = [len(t) for t in new_token_ids]
        seq_cpu = [p + n for p, n in zip(prefix_lens, ext_cpu, strict=True)]
        bs, num_tokens = len(ext_cpu), sum(ext_cpu)
        if len(out_cache_loc) != num_tokens:
            raise ValueError(
                f"out_cache_loc has {len(out_cache_loc)} slots for {num_tokens} tokens")
        req_to_token_pool.check_fits(max(seq_cpu, default=0))  # a longer one would spill rows
        width = req_to_token_pool.row_width
        # token j of request i sits at position prefix_i + j, table entry row_i * width + that
        token_ids = [t for ids in new_token_ids for t in ids]
        spans = list(zip(req_pool_indices, prefix_lens, seq_cpu, strict=True))
        positions = [j for _, p, s in spans for j in range(p, s)]
        table_index = [r * width + j for r, p, s in spans for j in range(p, s)]
        starts = list(accumulate(ext_cpu, initial=0))
        starts.pop()
        wide, narrow = send_packed(
            req_to_token_pool.device,
            token_ids + positions + list(out_cache_loc) + table_index + req_pool_indices
            + seq_cpu + prefix_lens + ext_cpu + starts,
            out_cache_loc)
        (input_ids, positions_d, slots, table_index_d, rows, seq_lens, prefix, ext,
         start) = wide.split_with_sizes([num_tokens] * 4 + [bs] * 5)  # one call, not split()
        req_to_token_pool.write(table_index_d, narrow)
        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=input_ids,
            positions=positions_d,
            seq_lens=seq_lens,
            prefix_lens=prefix,
            extend_seq_lens=ext,
            extend_start_loc=start,
            req_pool_indices=rows,
            out_cache_loc=slots,
            seq_lens_cpu=seq_cpu,
            extend_seq_lens_cpu=ext_cpu,
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )


def send_packed(device: torch.device, wide: Sequence[int], narrow: Sequence[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(`wide` as int64, `narrow` as int32) on `device`, sent in one host-to-device copy. The
    values are packed into one host buffer by the `array` module (a C loop; `torch.tensor` of a
    list costs ~0.2 us per element), and every step is one torch call (each costs host time)."""
    buffer = bytearray(array("q", wide))
    buffer += array("i", narrow)
    if not buffer:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty.view(torch.int32)
    host = torch.frombuffer(buffer, dtype=torch.uint8)
    on_device = host.to(device, non_blocking=True)  # pageable: staged before the call returns
    head, tail = on_device.split_with_sizes([8 * len(wide), 4 * len(narrow)])
    return head.view(torch.int64), tail.view(torch.int32)
