"""KVCache: one model's KV memory as one object: the paged KV pool, the allocator of its token
slots and the request-to-token table whose rows list each request's slots.

Built from the model's shapes and a token budget (`KVCache.allocate`), it is what the scheduler
side (batch building, the prefix cache) and the graph runners are handed; a second model (a
draft model) gets its own with the same call. Its sizes are the engine's limits: `size` token
slots, `max_requests` request rows, `context_len` tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replaylm.layers.quantization.fp8 import FP8_DTYPE
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool
from replaylm.mem_cache.token_allocator import TokenSlotAllocator


def resolve_kv_cache_dtype(flag: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for `--kv-cache-dtype flag`, one of its choices: auto is the model's
    dtype, fp8_e4m3 (and vLLM's alias fp8) float8 e4m3."""
    return model_dtype if flag == "auto" else FP8_DTYPE


@dataclass(frozen=True)
class KVShape:
    """What one token's K and V are made of, on this rank (`dtype`: the pool's)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return KVPool.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


@dataclass
class KVCache:
    pool: KVPool
    allocator: TokenSlotAllocator
    req_to_token: ReqToTokenPool

    @classmethod
    def allocate(
        cls,
        shape: KVShape,
        num_tokens: int,
        max_requests: int,
        context_len: int,
        device: torch.device,
    ) -> KVCache:
        """A cache of `num_tokens` slots (plus padding slot 0) for up to `max_requests`
        requests of at most `context_len` tokens each."""
        return cls(
            KVPool(
                num_tokens,
                shape.num_layers,
                shape.num_kv_heads,
                shape.head_dim,
                shape.dtype,
                device,
            ),
            TokenSlotAllocator(num_tokens),
            ReqToTokenPool(max_requests, context_len, device),
        )

    @property
    def size(self) -> int:
        """Token slots (`--max-total-tokens` as resolved)."""
        return self.allocator.size

    @property
    def max_requests(self) -> int:
        """Request rows (`--max-running-requests` as resolved)."""
        return self.req_to_token.max_reqs

    @property
    def context_len(self) -> int:
        """The longest request, prompt and output together."""
        return self.req_to_token.max_context_len

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device
