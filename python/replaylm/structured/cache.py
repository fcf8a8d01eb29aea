"""Compiled grammars kept by constraint, so that a schema seen recently costs nothing again.

The tokenizer manager keeps each constraint's serialized grammar (`GrammarCompiler.compile`), and
the scheduler process its compiled grammar (`GrammarLoader`), each in an LRU of `GRAMMARS_KEPT`.
The manager sends a grammar only with a request the scheduler may not hold it for: `HeldGrammars`
replays the loader's LRU on the manager's side, in the order requests go down the pipe, so the two
always agree on what the loader holds. This module imports nothing heavy (no xgrammar).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from replaylm.runtime.io_struct import TokenizedGenerateReq

GRAMMARS_KEPT = 16  # constraints whose grammars each side keeps (a few MB each)

Constraint = tuple[str, str]  # SamplingParams.constraint: (field, grammar text)
K = TypeVar("K")
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most `capacity` entries; adding one more drops the least recently used (read or
    added). `hits` / `misses` count the reads."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Whether `key` is kept; unlike `get`, this neither counts nor refreshes it."""
        return key in self._entries

    def get(self, key: K) -> V | None:
        """`key`'s value, now the most recently used; None when it is not kept."""
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Keep `value` for `key` as the most recently used, dropping the least recently used
        entry when that makes one too many."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


class HeldGrammars:
    """The manager's record of the constraints whose grammars the scheduler's `GrammarLoader`
    holds. It makes the loader's moves on the same requests in the same order (a request whose
    grammar is sent adds it, one sent without reads it), so it holds exactly what the loader
    holds. Call `sent` for every constrained request right after it goes down the pipe, under
    the lock that orders the pipe."""

    def __init__(self, capacity: int = GRAMMARS_KEPT) -> None:
        self._held: LruCache[Constraint, bool] = LruCache(capacity)
        self._vocabulary_sent = False

    def outgoing(self, msg: TokenizedGenerateReq, vocabulary: str) -> TokenizedGenerateReq:
        """Constrained `msg` as it goes down the pipe: without its grammar where the loader holds
        it (a grammar is megabytes), else, the first time, with the `vocabulary` its grammar was
        compiled against (the loader has none before). Then call `sent`."""
        constraint = msg.sampling_params.constraint
        assert constraint is not None, "only constrained requests carry grammars"
        if self.holds(constraint):
            return dataclasses.replace(msg, grammar=None)
        if self._vocabulary_sent:
            return msg
        self._vocabulary_sent = True
        return dataclasses.replace(msg, grammar_vocabulary=vocabulary)

    def holds(self, constraint: Constraint) -> bool:
        """Whether the loader holds `constraint`'s grammar: a request may go without it."""
        return constraint in self._held

    def sent(self, constraint: Constraint) -> None:
        """A request of `constraint` went down the pipe, with its grammar unless `holds` said
        the loader has it."""
        if self._held.get(constraint) is None:
            self._held.put(constraint, True)
