"""ForwardBatch: everything one forward pass of the model sees, as device tensors.

Tokens of all requests are packed along one flat token dimension (`T` = `num_tokens`): request
`i` owns tokens `extend_start_loc[i] : extend_start_loc[i] + extend_seq_lens[i]`. A mixed step
is an EXTEND batch whose first `num_decode` requests are running requests' decode tokens (one
each) riding along with the prefill chunks. Every field a kernel reads is a tensor here: a graph
runner reads them in place when the batch was built in its `GraphInputs` (as the scheduler's are),
or copies them in; the `*_cpu` lists are host copies for code that needs sizes without a device
sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from itertools import chain
from typing import TYPE_CHECKING

import torch

from replaylm.model_executor.packed_inputs import (
    TOKEN_FIELDS,
    GraphInputs,
    host_fields,
    pack_host,
    send_packed,
)

if TYPE_CHECKING:
    from replaylm.layers.attention.base import AttentionBackend
    from replaylm.mem_cache.kv_cache import KVCache


class ForwardMode(Enum):
    """EXTEND: prefill or chunked prefill (new tokens after a cached prefix, possibly empty).
    DECODE: one new token per request. TARGET_VERIFY: speculative decoding's check of each
    request's draft tokens (its last token and drafts after its cached prefix), laid out as
    decode rows: one row per token over its request's table row, its KV length ending at that
    token, so each row attends causally over prefix and earlier drafts through the decode
    kernels, and the decode graphs of every mode replay it. IDLE: no tokens (keeps the step
    loop uniform)."""

    EXTEND = auto()
    DECODE = auto()
    TARGET_VERIFY = auto()
    IDLE = auto()

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_decode_shaped(self) -> bool:
        """One new token per row, attended by the decode kernels (DECODE and TARGET_VERIFY)."""
        return self is ForwardMode.DECODE or self is ForwardMode.TARGET_VERIFY


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
    kv: KVCache
    attn_backend: AttentionBackend
    # EXTEND only: the first `num_decode` requests (and tokens) are decode tokens, one per
    # request, which an attention backend may run through its decode kernel
    num_decode: int = 0

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
        kv: KVCache,
        attn_backend: AttentionBackend,
        into: GraphInputs | None = None,
        num_decode: int = 0,
    ) -> ForwardBatch:
        """Pack per-request host lists into device tensors and record every new token's KV slot
        in the request table (`ReqToTokenPool.write`), so the batch's attention can read it.

        Every value is computed in plain Python on the host and the lot crosses to the table's
        device in one copy (the fields are views of it), so building a batch launches one kernel
        (the table write) and never waits for the device: a step-by-step server pays this host
        time every step, and every torch call adds to it.

        `new_token_ids[i]` are request i's tokens for this step, at positions
        `prefix_lens[i] ..`; their KV slots are `out_cache_loc` in the same packed order.

        `into`: the persistent inputs of the graph shape that will replay the batch. The batch
        is packed there, padded to `into.num_tokens` tokens with padding requests (see
        GraphInputs; their table entries are the padding row's, KV slot 0, as it stays), and the
        returned batch views its live part.
        """
        live, live_tokens = len(new_token_ids), len(out_cache_loc)
        table = kv.req_to_token
        if into is not None:
            ids, prefixes, rows, slots = into.padding_requests(live_tokens, live)
            new_token_ids = [*new_token_ids, *ids]
            prefix_lens = [*prefix_lens, *prefixes]
            req_pool_indices = [*req_pool_indices, *rows]
            out_cache_loc = [*out_cache_loc, *slots]
        host = host_fields(
            new_token_ids, prefix_lens, req_pool_indices, out_cache_loc, table.row_width
        )
        seq_cpu, ext_cpu = host[5], host[7]  # PACKED_FIELDS' seq_lens, extend_seq_lens
        bs, num_tokens = len(ext_cpu), len(host[0])
        if len(out_cache_loc) != num_tokens:
            raise ValueError(
                f"out_cache_loc has {len(out_cache_loc)} slots for {num_tokens} tokens"
            )
        table.check_fits(max(seq_cpu, default=0))  # a longer one would spill rows
        if into is not None and into.max_requests > bs:  # request fields `max_requests` long
            host[TOKEN_FIELDS:] = [
                [*f, *[0] * (into.max_requests - bs)] for f in host[TOKEN_FIELDS:]
            ]
        wide = list(chain.from_iterable(host))
        if into is None:
            wide_d, narrow = send_packed(table.device, wide, out_cache_loc)
            fields = wide_d.split_with_sizes(  # one call
                [num_tokens] * TOKEN_FIELDS + [bs] * (len(host) - TOKEN_FIELDS)
            )
        else:
            into.load(pack_host(wide, out_cache_loc))
            fields, narrow = into.fields, into.slots32
        table.write(fields[3], narrow)
        if into is not None:
            fields = into.views(live_tokens, live)
        return cls.from_fields(
            forward_mode, fields, seq_cpu[:live], ext_cpu[:live], kv, attn_backend, num_decode
        )

    @classmethod
    def from_fields(
        cls,
        forward_mode: ForwardMode,
        fields: Sequence[torch.Tensor],
        seq_lens_cpu: list[int],
        extend_seq_lens_cpu: list[int],
        kv: KVCache,
        attn_backend: AttentionBackend,
        num_decode: int = 0,
    ) -> ForwardBatch:
        """A batch over device tensors in `PACKED_FIELDS` order (the table index is not kept)."""
        input_ids, positions, slots, _, rows, seq_lens, prefix, ext, start = fields
        return cls(
            forward_mode=forward_mode,
            batch_size=len(seq_lens_cpu),
            input_ids=input_ids,
            positions=positions,
            seq_lens=seq_lens,
            prefix_lens=prefix,
            extend_seq_lens=ext,
            extend_start_loc=start,
            req_pool_indices=rows,
            out_cache_loc=slots,
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            kv=kv,
            attn_backend=attn_backend,
            num_decode=num_decode,
        )
