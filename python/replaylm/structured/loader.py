"""Loading the manager's serialized grammars in the scheduler process."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from replaylm.structured.cache import GRAMMARS_KEPT, Constraint, LruCache

if TYPE_CHECKING:
    import xgrammar as xgr

    from replaylm.structured.grammar import RequestGrammar


class GrammarLoader:
    """Turns serialized compiled grammars into RequestGrammars, keeping the compiled grammars of
    the `capacity` constraints used last (a compiled grammar is read-only: every request of a
    constraint starts its own matcher over the same one). The tokenizer's vocabulary (from
    `describe_vocabulary`) comes with the first grammar, or as `description`; it is sized to
    `vocab_size` (and xgrammar imported) on the first load, since most servers never see a
    constrained request. `deserialized`: how many grammars it has deserialized."""

    def __init__(
        self,
        vocab_size: int,
        stop_token_ids: Collection[int],
        capacity: int = GRAMMARS_KEPT,
        description: str | None = None,
    ) -> None:
        self._description = description
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._tokenizer_info: xgr.TokenizerInfo | None = None
        self.held: LruCache[Constraint, xgr.CompiledGrammar] = LruCache(capacity)
        self.deserialized = 0

    def load(
        self, constraint: Constraint, serialized: str | None, vocabulary: str | None = None
    ) -> RequestGrammar:
        """A new matcher of `constraint`'s grammar, deserialized from `serialized`, or, when that
        is None, the grammar held from an earlier request (the manager leaves the grammar out
        only when `HeldGrammars` says this loader holds it). RuntimeError when it does not.
        `vocabulary`: the description grammars are compiled against, where this request brings
        it (the first constrained one does)."""
        import xgrammar as xgr

        from replaylm.structured.grammar import RequestGrammar
        from replaylm.structured.vocabulary import sized_vocabulary

        if serialized is None:
            compiled = self.held.get(constraint)
            if compiled is None:
                raise RuntimeError(f"a request of an unknown {constraint[0]} came without it")
        else:
            if vocabulary is not None:
                self._description = vocabulary
            if self._tokenizer_info is None:
                if self._description is None:
                    raise RuntimeError("a grammar came before the vocabulary it was compiled for")
                self._tokenizer_info = sized_vocabulary(self._description, self._vocab_size)
            compiled = xgr.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info)
            self.deserialized += 1
            self.held.put(constraint, compiled)
        return RequestGrammar.start(compiled, self._stop_token_ids)
