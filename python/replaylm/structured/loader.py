"""Loading the manager's serialized grammars in the scheduler process."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

    from replaylm.structured.grammar import RequestGrammar


class GrammarLoader:
    """Turns serialized compiled grammars into RequestGrammars. `description`: the tokenizer's
    vocabulary from `describe_vocabulary`; it is sized to `vocab_size` (and xgrammar imported)
    on the first load, since most servers never see a constrained request."""

    def __init__(self, description: str, vocab_size: int, stop_token_ids: Collection[int]):
        self._description = description
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._tokenizer_info: xgr.TokenizerInfo | None = None

    def load(self, serialized: str) -> RequestGrammar:
        import xgrammar as xgr

        from replaylm.structured.grammar import RequestGrammar
        from replaylm.structured.vocabulary import sized_vocabulary

        if self._tokenizer_info is None:
            self._tokenizer_info = sized_vocabulary(self._description, self._vocab_size)
        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info)
        return RequestGrammar.start(compiled, self._stop_token_ids)
