"""The scheduler's KV memory with the prefix cache: which of a request's slots are shared, when
they enter the radix tree, and what can be freed for new work.

A request admitted with a cached prefix adopts the tree's slots for it (locked while it holds
them) and prefills only the rest. After each prefill step its cached tokens are inserted, so a
prompt is shared as soon as it is computed (later requests, the other `n > 1` choices, the next
chunk's duplicates); when it finishes, is retracted or aborted, its tokens stay in the tree and
only its row is given back. Free KV counts what eviction can take: unlocked tree nodes, least
recently used first. With the cache off (`enabled=False`) every method keeps today's
behaviour: nothing is matched, release frees everything, forks copy the prompt's KV.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from replaylm.mem_cache.radix_cache import PrefixMatch, RadixCache
from replaylm.runtime.batch_ops import fork, release, write_rows

if TYPE_CHECKING:
    from replaylm.mem_cache.kv_cache import KVCache
    from replaylm.runtime.request import Req

logger = logging.getLogger(__name__)


class PrefixCache:
    def __init__(self, kv: KVCache, enabled: bool) -> None:
        self.kv = kv
        self.allocator = kv.allocator
        self.tree = RadixCache(self.allocator) if enabled else None
        self.prompt_tokens = 0  # prompt tokens of first admissions, and of them found cached
        self.cached_tokens = 0
        logger.info(
            "prefix cache: %s",
            "on (a radix tree over the KV pool, page size 1)"
            if enabled
            else "off (--disable-radix-cache)",
        )

    @property
    def available(self) -> int:
        """KV slots new work can have: free ones plus those eviction can take."""
        evictable = self.tree.evictable_size if self.tree is not None else 0
        return self.allocator.available_size() + evictable

    def make_room(self, need: int) -> None:
        """Evict least recently used prefixes until `need` slots are free (as far as possible)."""
        short = need - self.allocator.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)

    def match(self, req: Req) -> PrefixMatch | None:
        """The cached prefix a request without KV could start from (perhaps empty); None where
        the cache does not apply: it is off, the request holds KV already, or it wants prompt
        logprobs (every position computed). Its last token is always computed (its logits are
        needed)."""
        if self.tree is None or req.kv_slots or req.prompt_logprobs is not None:
            return None
        return self.tree.match_prefix(req.id_slice(0, req.num_ids - 1))

    def lock_cost(self, found: PrefixMatch | None) -> int:
        """How much locking a match would take out of `available`."""
        if found is None or self.tree is None:
            return 0
        return self.tree.unlocked_above(found.node)

    def admit(self, req: Req, found: PrefixMatch | None) -> None:
        """Record an admitted request's prompt and take its cached prefix, locking it."""
        cached = len(found.slots) if found is not None else 0
        if req.admitted_at is None:  # a first admission (not a later chunk or a re-admission)
            req.cached_tokens = cached
            self.prompt_tokens += len(req.input_ids)
            self.cached_tokens += cached
        if found is not None and found.slots:
            assert self.tree is not None
            self.tree.lock(found.node)
            req.prefix_node, req.kv_slots, req.shared_len = found.node, list(found.slots), cached

    def cache_computed(self, req: Req) -> None:
        """Share a request's computed tokens (after a prefill step): insert them, adopt the
        tree's slots where the tree had its own (freeing the duplicates and rewriting the row),
        and lock the longer prefix."""
        if self.tree is None or req.req_pool_idx is None:
            return
        n = min(req.kv_len, req.num_ids)
        ids = req.id_slice(0, n)
        known = self.tree.insert(ids, req.kv_slots[:n])
        duplicates = req.kv_slots[req.shared_len : known]
        found = self.tree.match_prefix(ids)
        self.tree.lock(found.node)
        self._unlock(req)
        if duplicates:
            self.allocator.free(duplicates)
            write_rows(
                [(req.req_pool_idx, req.shared_len, found.slots[req.shared_len : known])],
                self.kv,
            )
        req.kv_slots[:n] = found.slots
        req.prefix_node, req.shared_len = found.node, n

    def release(self, req: Req) -> None:
        """Give back a request's row, keeping its computed tokens in the tree (the cache on) or
        freeing its slots (off)."""
        if self.tree is not None and req.req_pool_idx is not None:
            n = min(req.kv_len, req.num_ids)  # an abort may leave a slot past its last token
            known = self.tree.insert(req.id_slice(0, n), req.kv_slots[:n])
            self.allocator.free(req.kv_slots[req.shared_len : known] + req.kv_slots[n:])
            self._unlock(req)
            self.kv.req_to_token.free(req.req_pool_idx)
            req.req_pool_idx, req.kv_slots, req.shared_len = None, [], 0
            return
        release(req, self.kv)

    def fork(self, parent: Req, children: list[Req]) -> None:
        """The other choices of a prefilled `n > 1` request, sharing its cached prompt (the cache
        on: `cache_computed` has just inserted it) or copying it (off)."""
        if self.tree is None or parent.prefix_node is None:
            self.make_room(parent.kv_len * len(children))
            fork(parent, children, self.kv)
            return
        fork(parent, children, self.kv, share=True)
        for child in children:
            self.tree.lock(parent.prefix_node)
            child.prefix_node, child.shared_len = parent.prefix_node, parent.shared_len

    def flush(self) -> int:
        """Evict every prefix no request holds; the number of tokens freed."""
        freed = self.tree.flush() if self.tree is not None else 0
        logger.info("prefix cache flushed: %d tokens freed", freed)
        return freed

    def _unlock(self, req: Req) -> None:
        if req.prefix_node is not None:
            assert self.tree is not None
            self.tree.unlock(req.prefix_node)
            req.prefix_node = None
