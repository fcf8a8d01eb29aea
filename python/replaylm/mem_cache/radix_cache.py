"""Radix tree of cached prefixes: token ids -> the KV slots that hold their keys and values.

Each edge of the tree is a run of token ids (page size 1: any token may end a node; pages of
more than one token are not supported) with the KV slot of every token in it, so a path from the
root spells a cached prefix. A new request reuses the slots of its longest cached prefix and
prefills only the rest.

Ownership: slots stored in the tree belong to the tree, which frees them (through the allocator)
only when it evicts them. `insert` takes ownership of the caller's slots for the suffix it adds;
for the leading ids that were already cached it keeps its own slots and returns how many there
were, and the caller frees its own duplicates among those (never the slots it got from
`match_prefix`, which are the tree's).

Locking: a running request locks the node its match ended at; the node and all its ancestors
are then protected (reference counted, so requests sharing a prefix nest). Eviction takes
unlocked leaves, least recently used first (a monotonic counter, bumped by each match and
insert, orders them); a parent whose last child went becomes a leaf and a candidate itself.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from replaylm.mem_cache.token_allocator import TokenSlotAllocator


@dataclass(eq=False)  # identity equality and hashing: nodes live in sets
class TreeNode:
    """One edge of the tree: `key` token ids whose K/V live in `slots` (same length)."""

    key: tuple[int, ...]
    slots: list[int]
    parent: TreeNode | None
    node_id: int  # creation order: breaks ties between equally recent leaves
    last_access: int = 0
    lock_ref: int = 0  # running requests whose match ends at this node or below it
    children: dict[int, TreeNode] = field(default_factory=dict)  # by first token of their key


@dataclass
class PrefixMatch:
    slots: list[int]  # KV slots of the matched tokens, in order
    node: TreeNode  # the deepest node of the match (the root when nothing matched); lock/unlock it


def _common_length(key: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    """Length of the common prefix of `key` and `ids[start:]`."""
    window = tuple(ids[start : start + len(key)])
    if window == key:  # the usual case, compared in C: long shared prompts walk whole edges
        return len(key)
    n = 0
    for a, b in zip(key, window, strict=False):
        if a != b:
            break
        n += 1
    return n


class RadixCache:
    def __init__(self, allocator: TokenSlotAllocator) -> None:
        self.allocator = allocator
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = TreeNode(key=(), slots=[], parent=None, node_id=next(self._ids))
        self._evictable = 0
        self._protected = 0
        self._evictable_leaves: set[TreeNode] = set()  # unlocked childless non-root nodes

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    def match_prefix(self, ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `ids`. A match ending inside a node splits it, so the
        returned node covers exactly the match. Marks the matched path as used now."""
        now = next(self._clock)
        node = self.root
        node.last_access = now
        slots: list[int] = []
        pos = 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_length(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)  # the next token (if any) differs: loop ends
            child.last_access = now
            slots.extend(child.slots)
            node = child
            pos += n
        return PrefixMatch(slots=slots, node=node)

    def insert(self, ids: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `ids` -> `slots`. Returns how many leading ids were already cached: the tree
        keeps its own slots for those and the caller frees its duplicates among
        `slots[:returned]`. The slots of the new suffix now belong to the tree. Marks the path
        as used now."""
        if len(ids) != len(slots):
            raise ValueError(f"insert needs one slot per token: {len(ids)} ids, {len(slots)} slots")
        now = next(self._clock)
        node = self.root
        node.last_access = now
        pos = 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = TreeNode(
                    key=tuple(ids[pos:]),
                    slots=list(slots[pos:]),
                    parent=node,
                    node_id=next(self._ids),
                    last_access=now,
                )
                node.children[leaf.key[0]] = leaf
                self._evictable += len(leaf.key)
                self._refresh_leaf(node)
                self._refresh_leaf(leaf)
                break
            n = _common_length(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node = child
            pos += n
        return pos

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (nested: one `unlock` per `lock`)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlocked_above(self, node: TreeNode) -> int:
        """Tokens that `lock(node)` would take out of the evictable ones."""
        n = 0
        while node is not self.root and node.lock_ref == 0:  # a locked node's ancestors are too
            n += len(node.key)
            assert node.parent is not None
            node = node.parent
        return n

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock` of `node`."""
        while node is not self.root:
            if node.lock_ref == 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                self._refresh_leaf(node)
            assert node.parent is not None
            node = node.parent

    def evict(self, need: int) -> int:
        """Free at least `need` tokens (all that are evictable, if fewer) from the least recently
        used unlocked leaves, through the allocator. Whole nodes go, so more may be freed.
        Returns the number of tokens freed."""
        heap = [(leaf.last_access, leaf.node_id, leaf) for leaf in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < need and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._evictable_leaves.discard(leaf)
            self._evictable -= len(leaf.key)
            self.allocator.free(leaf.slots)
            freed += len(leaf.key)
            self._refresh_leaf(parent)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def flush(self) -> int:
        """Evict everything evictable (every unlocked node). Returns the number of tokens freed."""
        return self.evict(self._evictable)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first `n` tokens (0 < n < len(key)); returns the new upper node.
        `child` keeps the lower part, so a request holding it still holds its whole match."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(
            key=child.key[:n],
            slots=child.slots[:n],
            parent=parent,
            node_id=next(self._ids),
            last_access=child.last_access,
            lock_ref=child.lock_ref,  # same requests hold it: sizes stay as they are
            children={child.key[n]: child},
        )
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.slots = child.slots[n:]
        child.parent = upper
        return upper

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Keep `node`'s membership of the evictable leaves current."""
        if node is not self.root and node.lock_ref == 0 and not node.children:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)
