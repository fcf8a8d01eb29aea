"""RadixCache over a real TokenSlotAllocator: matching, splitting, insert's ownership contract,
locking, LRU eviction back to the allocator, and a seeded random workload checked after every op."""

from __future__ import annotations

import random

import pytest

from replaylm.mem_cache.radix_cache import RadixCache, TreeNode
from replaylm.mem_cache.token_allocator import TokenSlotAllocator


def _cache(size: int = 64) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(size)
    return alloc, RadixCache(alloc)


def _cache_ids(cache: RadixCache, ids: list[int]) -> list[int]:
    """Insert `ids` with fresh slots, as a finished request would, freeing its duplicates."""
    slots = cache.allocator.alloc(len(ids))
    cached = cache.insert(ids, slots)
    cache.allocator.free(slots[:cached])
    return cache.match_prefix(ids).slots


def _nodes(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _tree_slots(cache: RadixCache) -> list[int]:
    return [s for node in _nodes(cache) for s in node.slots]


def _path_slots(node: TreeNode) -> list[int]:
    """Slots from the root down to `node`, read without a match (which would touch the LRU)."""
    parts = []
    while node.parent is not None:
        parts.append(node.slots)
        node = node.parent
    return [s for part in reversed(parts) for s in part]


def _check_tree(cache: RadixCache) -> None:
    """Structure and size bookkeeping agree with a walk of the tree."""
    evictable = protected = 0
    for node in _nodes(cache):
        assert node.key and len(node.key) == len(node.slots)
        assert node.parent is not None and node.parent.children[node.key[0]] is node
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
    assert (cache.evictable_size, cache.protected_size) == (evictable, protected)
    assert cache.total_size == evictable + protected


def test_empty_cache_matches_nothing_at_the_root():
    alloc, cache = _cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.slots == [] and m.node is cache.root
    assert cache.match_prefix([]).node is cache.root
    cache.lock(m.node)  # locking the root is allowed and protects nothing
    assert cache.protected_size == 0
    cache.unlock(m.node)
    assert cache.insert([], []) == 0 and cache.total_size == 0


def test_insert_and_match_disjoint_sequences():
    alloc, cache = _cache()
    a, b = alloc.alloc(3), alloc.alloc(2)
    assert cache.insert([1, 2, 3], a) == 0
    assert cache.insert([7, 8], b) == 0
    assert cache.match_prefix([1, 2, 3]).slots == a
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == a
    assert cache.match_prefix([7, 8, 9]).slots == b
    assert cache.match_prefix([2, 3]).slots == []
    assert cache.total_size == cache.evictable_size == 5
    assert alloc.available_size() == 64 - 5
    _check_tree(cache)


def test_shared_prefix_is_stored_once():
    alloc, cache = _cache()
    a = alloc.alloc(5)
    cache.insert([1, 2, 3, 4, 5], a)
    b = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 9, 9], b) == 3
    alloc.free(b[:3])
    assert cache.match_prefix([1, 2, 3, 9, 9]).slots == a[:3] + b[3:]
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == a
    assert cache.match_prefix([1, 2, 3, 0]).slots == a[:3]
    assert cache.total_size == 7 and alloc.available_size() == 64 - 7
    _check_tree(cache)


def test_match_ending_inside_a_node_splits_it():
    alloc, cache = _cache()
    a = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    m = cache.match_prefix([1, 2, 3, 0])
    assert m.slots == a[:3] and m.node.key == (1, 2, 3)  # the node covers exactly the match
    assert [c.key for c in m.node.children.values()] == [(4, 5, 6)]
    # Both halves match later with the slots unchanged, and nothing was allocated or freed.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots == a
    assert cache.match_prefix([1, 2, 3]).node is m.node
    assert cache.match_prefix([1, 2]).slots == a[:2]
    assert cache.total_size == 6 and alloc.available_size() == 64 - 6
    _check_tree(cache)


def test_insert_returns_the_length_already_cached():
    alloc, cache = _cache()
    a = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], a) == 0
    dup = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], dup) == 4  # full duplicate: the tree keeps its own slots
    alloc.free(dup)
    assert cache.match_prefix([1, 2, 3, 4]).slots == a
    shorter = alloc.alloc(2)
    assert cache.insert([1, 2], shorter) == 2  # ends inside a node
    alloc.free(shorter)
    longer = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], longer) == 4  # extends a leaf
    alloc.free(longer[:4])
    branch = alloc.alloc(3)
    assert cache.insert([1, 2, 8], branch) == 2  # diverges inside a node
    alloc.free(branch[:2])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots == a + longer[4:]
    assert cache.match_prefix([1, 2, 8]).slots == a[:2] + branch[2:]
    assert cache.total_size == 7 and alloc.available_size() == 64 - 7
    _check_tree(cache)


def test_insert_rejects_mismatched_lengths():
    _, cache = _cache()
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert([1, 2, 3], [5, 6])


def test_lock_moves_the_path_between_evictable_and_protected():
    alloc, cache = _cache()
    _cache_ids(cache, [1, 2, 3, 4])
    _cache_ids(cache, [1, 2, 5, 6, 7])
    _cache_ids(cache, [9])
    assert (cache.evictable_size, cache.protected_size) == (8, 0)
    a = cache.match_prefix([1, 2, 3, 4]).node
    b = cache.match_prefix([1, 2, 5, 6, 7]).node
    cache.lock(a)
    assert (cache.evictable_size, cache.protected_size) == (4, 4)
    cache.lock(b)  # shares the ancestor [1, 2]: counted once
    assert (cache.evictable_size, cache.protected_size) == (1, 7)
    cache.lock(a)  # nested
    cache.unlock(a)
    assert (cache.evictable_size, cache.protected_size) == (1, 7)
    cache.unlock(a)
    assert (cache.evictable_size, cache.protected_size) == (3, 5)  # [1, 2] still held by b
    _check_tree(cache)
    cache.unlock(b)
    assert (cache.evictable_size, cache.protected_size) == (8, 0)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(b)
    _check_tree(cache)


def test_split_of_a_locked_node_keeps_the_lock_on_both_halves():
    _, cache = _cache()
    _cache_ids(cache, [1, 2, 3, 4])
    held = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(held)
    upper = cache.match_prefix([1, 2]).node  # splits the locked node
    assert upper is not held and held.parent is upper
    assert upper.lock_ref == held.lock_ref == 1 and cache.protected_size == 4
    assert cache.evict(4) == 0
    cache.unlock(held)  # the request's unlock walks through the new upper node
    assert (cache.evictable_size, cache.protected_size) == (4, 0)
    _check_tree(cache)


def test_evict_frees_least_recently_used_leaves_to_the_allocator():
    alloc, cache = _cache()
    old = _cache_ids(cache, [1, 1])
    _cache_ids(cache, [2, 2, 2])
    new = _cache_ids(cache, [3, 3])
    cache.match_prefix([1, 1])  # [1, 1] is now the most recent; [2, 2, 2] the least
    free_before = alloc.available_size()
    assert cache.evict(1) == 3  # whole nodes go
    assert alloc.available_size() == free_before + 3
    assert cache.match_prefix([2, 2, 2]).slots == []
    assert cache.match_prefix([3, 3]).slots == new  # a match makes [3, 3] the most recent
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 1]).slots == [] and cache.match_prefix([3, 3]).slots == new
    free_now = set(alloc.alloc(alloc.available_size()))
    assert set(old) <= free_now and not free_now & set(new)
    assert cache.total_size == 2


def test_evict_cascades_to_parents_that_become_leaves():
    alloc, cache = _cache()
    _cache_ids(cache, [1, 2, 3])
    _cache_ids(cache, [1, 2, 4])
    _cache_ids(cache, [7, 7, 7, 7])  # most recent
    # [1, 2] has two leaves below it; once both go, it is the least recent leaf and goes next.
    assert cache.evict(4) == 4
    assert cache.match_prefix([1]).slots == [] and len(cache.match_prefix([7, 7, 7, 7]).slots) == 4
    assert cache.total_size == 4 and alloc.available_size() == 64 - 4
    _check_tree(cache)


def test_evict_takes_what_there_is_and_skips_locked_nodes():
    alloc, cache = _cache()
    _cache_ids(cache, [1, 2, 3])
    _cache_ids(cache, [1, 2, 4, 5])
    locked = cache.match_prefix([1, 2, 3]).node
    cache.lock(locked)
    assert cache.evict(100) == 2  # only [4, 5]: [1, 2] is an ancestor of a locked node
    assert cache.evict(1) == 0
    assert cache.match_prefix([1, 2, 3]).node is locked
    cache.unlock(locked)
    assert cache.evict(1) == 1 and cache.evict(1) == 2  # the leaf [3] first, then its parent
    assert cache.total_size == 0 and alloc.available_size() == 64


def test_evict_never_frees_a_locked_nodes_slots():
    alloc, cache = _cache(32)
    held_ids = [5, 6, 7, 8]
    held_slots = _cache_ids(cache, held_ids)
    held = cache.match_prefix(held_ids).node
    cache.lock(held)
    for first in range(10, 16):  # newer, unlocked neighbours, some sharing [5, 6]
        _cache_ids(cache, [5, 6, first])
        _cache_ids(cache, [first, first])
    total = cache.total_size
    assert cache.evict(total) == total - 4
    everything_free = alloc.alloc(alloc.available_size())
    assert not set(everything_free) & set(held_slots)
    assert len(everything_free) == 32 - 4
    assert cache.match_prefix(held_ids).slots == held_slots


def test_flush_evicts_all_unlocked_nodes():
    alloc, cache = _cache()
    _cache_ids(cache, [1, 2, 3])
    _cache_ids(cache, [1, 2, 9])
    _cache_ids(cache, [4, 5])
    node = cache.match_prefix([1, 2, 9]).node
    cache.lock(node)
    assert cache.flush() == 3  # [3] and [4, 5]
    assert (cache.evictable_size, cache.protected_size) == (0, 3)
    cache.unlock(node)
    assert cache.flush() == 3
    assert cache.total_size == 0 and alloc.available_size() == 64
    assert cache.root.children == {}


def test_random_workload_keeps_every_slot_accounted_for():
    """Requests share a few prefixes; each one matches, locks its match, holds fresh slots for its
    suffix while it runs, then inserts and unlocks. Evictions come on demand and at random."""
    rng = random.Random(29)
    size = 160
    alloc, cache = _cache(size)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    running: list[tuple[list[int], list[int], list[int], TreeNode]] = []  # ids, cached, own, node
    truth: dict[tuple[int, ...], int] = {}  # prefix -> slot of its last token, as inserted

    def check() -> None:
        _check_tree(cache)
        held = [s for _, _, own, _ in running for s in own]
        tree = _tree_slots(cache)
        free = alloc.alloc(alloc.available_size())
        alloc.free(free)
        everything = tree + held + free
        assert len(everything) == len(set(everything)) == size
        assert alloc.available_size() + cache.total_size + len(held) == alloc.size
        for _, cached, _, node in running:  # locked prefixes are still there, same slots
            assert _path_slots(node) == cached

    def check_match(ids: list[int]) -> list[int]:
        slots = cache.match_prefix(ids).slots
        assert slots == [truth[tuple(ids[: i + 1])] for i in range(len(slots))]
        return slots

    for _ in range(400):
        op = rng.random()
        if op < 0.35:  # a request arrives
            ids = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
            m = cache.match_prefix(ids)
            assert m.slots == check_match(ids)
            cache.lock(m.node)
            need = len(ids) - len(m.slots)
            if alloc.available_size() < need:
                cache.evict(need - alloc.available_size())
            if alloc.available_size() < need:
                cache.unlock(m.node)
            else:
                running.append((ids, m.slots, alloc.alloc(need), m.node))
        elif op < 0.65 and running:  # a request finishes: its suffix joins the tree
            ids, cached, own, node = running.pop(rng.randrange(len(running)))
            slots = cached + own
            done = cache.insert(ids, slots)
            assert done >= len(cached)
            alloc.free(slots[len(cached) : done])  # duplicates of what another request cached
            for i in range(done, len(ids)):
                truth[tuple(ids[: i + 1])] = slots[i]
            cache.unlock(node)
        elif op < 0.75:  # an insert of fresh slots, no match first (full or partial duplicate)
            ids = rng.choice(prefixes)[: rng.randrange(1, 12)]
            if alloc.available_size() >= len(ids):
                slots = alloc.alloc(len(ids))
                done = cache.insert(ids, slots)
                alloc.free(slots[:done])
                for i in range(done, len(ids)):
                    truth[tuple(ids[: i + 1])] = slots[i]
        elif op < 0.9:  # a lookup only
            check_match(rng.choice(prefixes) + [rng.randrange(4) for _ in range(3)])
        else:
            need = rng.randrange(1, 20)
            before_free, evictable = alloc.available_size(), cache.evictable_size
            freed = cache.evict(need)
            assert freed >= min(need, evictable) and freed <= evictable
            assert alloc.available_size() == before_free + freed
        check()

    while running:
        ids, cached, own, node = running.pop()
        alloc.free(own)
        cache.unlock(node)
    assert cache.protected_size == 0
    cache.flush()
    assert cache.total_size == 0 and alloc.available_size() == size
