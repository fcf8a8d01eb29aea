"""Incremental detokenization: text deltas that are correct for multi-byte characters.

Decoding token by token splits characters whose bytes span several tokens (emoji, CJK in
byte-level BPE) and loses the spaces that SentencePiece-style tokenizers attach to the next word.
So each step decodes a short window of recent tokens twice (with and without the new ones) and
emits the difference, holding back text while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
_WINDOW = 5  # tokens of context decoded before the new ones


class IncrementalDetokenizer:
    """Feed generated ids with `add`; `text` is everything decoded so far.

    With stop strings, `releasable()` keeps back the tail that could still become a stop string;
    `final_text(matched)` cuts at a matched stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """The two flags are the tokenizer's decode options (the second has an effect on slow
        tokenizers only, as in transformers)."""
        self.tokenizer = tokenizer
        self._options = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens already turned into text
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._options)

    def _pending(self) -> tuple[str, str]:
        """(text of the context window, text of the window plus the unread tokens)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        return prefix, self._decode(self.ids[self._prefix_offset :])

    def add(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        prefix, full = self._pending()
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return  # an incomplete character (or nothing visible yet): wait for more tokens
        self.text += full[len(prefix) :]
        self._prefix_offset = max(len(self.ids) - _WINDOW, self._read_offset)
        self._read_offset = len(self.ids)

    def releasable(self) -> str:
        """The text that can be shown now (everything, less a possible stop-string start)."""
        return self.text[: len(self.text) - self._holdback] if self._holdback else self.text

    def final_text(self, matched_stop: str | None) -> str:
        """All text at the end (a trailing incomplete character included), cut at the stop."""
        prefix, full = self._pending()
        text = self.text + full[len(prefix) :]
        if matched_stop and matched_stop in text:
            return text[: text.index(matched_stop)]
        return text
