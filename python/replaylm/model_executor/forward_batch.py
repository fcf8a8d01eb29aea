"""ForwardBatch: everything one forward pass of the model sees, as device tensors.

Tokens of all requests are packed along one flat token dimension (`T` = `num_tokens`): request `i`
owns tokens `extend_start_loc[i] : extend_start_loc[i] + extend_seq_lens[i]`. A graph runner later
copies these tensors into its static buffers, so every field a kernel reads is a tensor here; the
`*_cpu` lists are host copies for code that needs sizes without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
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
        out_cache_loc: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
    ) -> ForwardBatch:
        """Pack per-request host lists into device tensors: every index field is computed on
        the host and the lot crosses to the device in one copy (the fields are views of it), so
        building a batch launches no kernel and never waits for the device. A step-by-step
        server pays this host time every step (a launch or a copy each costs several us).

        `new_token_ids[i]` are request i's tokens for this step, at positions
        `prefix_lens[i] ..`; their KV slots are `out_cache_loc` in the same packed order.
        """
        device = out_cache_loc.device
        ext_cpu = [len(t) for t in new_token_ids]
        seq_cpu = [p + n for p, n in zip(prefix_lens, ext_cpu, strict=True)]
        flat_ids = [tok for toks in new_token_ids for tok in toks]
        if out_cache_loc.numel() != len(flat_ids):
            raise ValueError(
                f"out_cache_loc has {out_cache_loc.numel()} slots for {len(flat_ids)} tokens"
            )
        bs, num_tokens = len(ext_cpu), len(flat_ids)
        per_request = torch.tensor([ext_cpu, prefix_lens, seq_cpu, req_pool_indices],
                                   dtype=torch.int64).view(4, bs)
        ext, prefix = per_request[0], per_request[1]
        start = torch.cumsum(ext, 0) - ext
        # token j of request i sits at position prefix_i + j
        positions = (torch.arange(num_tokens) + torch.repeat_interleave(prefix - start, ext,
                                                                        output_size=num_tokens))
        packed = torch.cat([torch.tensor(flat_ids, dtype=torch.int64), positions,
                            per_request.flatten(), start])
        on_device = packed.to(device, non_blocking=True)
        input_ids, positions, per_request, start = on_device.split(
            [num_tokens, num_tokens, 4 * bs, bs])
        ext, prefix, seq_lens, rows = per_request.view(4, bs)
        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=input_ids,
            positions=positions,
            seq_lens=seq_lens,
            prefix_lens=prefix,
            extend_seq_lens=ext,
            extend_start_loc=start,
            req_pool_indices=rows,
            out_cache_loc=out_cache_loc.to(torch.int64),
            seq_lens_cpu=seq_cpu,
            extend_seq_lens_cpu=ext_cpu,
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )
