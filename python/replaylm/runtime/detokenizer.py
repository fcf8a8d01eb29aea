"""Incremental detokenization: text deltas that are correct for multi-byte characters.

Decoding token by token splits characters whose bytes span several tokens (emoji, CJK in
byte-level BPE) and loses the spaces that SentencePiece-style tokenizers attach to the next word.
So each step decodes a short window of recent tokens twice (with and without the new ones) and
emits the difference, holding back text while it ends in an incomplete character (U+FFFD). A
tokenizer that decodes as its tokenizers backend does streams through the backend's own
`DecodeStream` instead (the same text, one call per step); its last incomplete character, if the
output ends in one, comes from the window.
"""

from __future__ import annotations

from replaylm.model_loader.tokenizer import Decoder, StreamStep

_REPLACEMENT = "\ufffd"
_WINDOW = 5  # tokens of context decoded before the new ones


class IncrementalDetokenizer:
    """Feed generated ids with `add`; `text` is everything decoded so far.

    With stop strings, `releasable()` keeps back the tail that could still become a stop string;
    `final_text(matched)` cuts at a matched stop string.
    """

    def __init__(self, decode: Decoder, stop: list[str], step: StreamStep | None = None) -> None:
        """`decode`: ids -> text under the request's decode options (`token_decoder`); `step`:
        the same decode as a stream (`stream_step`), which `add` then takes."""
        self._decode = decode
        self._step = step
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens already turned into text
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _pending(self) -> tuple[str, str]:
        """(text of the context window, text of the window plus the unread tokens)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        return prefix, self._decode(self.ids[self._prefix_offset :])

    def add(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        if self._step is not None:
            try:
                new = self._step(new_ids)
            except Exception:  # the backend refuses some sequences: the window decodes the rest
                self._step = None
            else:
                if new is not None:  # None: an incomplete character, wait for more tokens
                    self._release(new)
                return
        prefix, full = self._pending()
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return  # an incomplete character (or nothing visible yet): wait for more tokens
        self._release(full[len(prefix) :])

    def _release(self, new: str) -> None:
        """Append the text `new` that every id so far completes."""
        self.text += new
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
