"""A stream's chunks as JSON text without a pydantic model per chunk, for the chunk that nearly
every streamed token is: one choice carrying new text and nothing else.

The templates are cut from the models' own serialization: a chunk of the stream with no choice
(its id, `created`, model and fingerprint, fixed for the stream as OpenAI's are), split where its
choices go, and a text-only choice of each index, split where its text goes. Filling them gives
what the model would dump (a test holds them equal), at a fraction of the CPU that building and
dumping two models per token costs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from json.encoder import encode_basestring  # json.dumps(text, ensure_ascii=False), at less cost

from pydantic import BaseModel

from replaylm.entrypoints.http_streaming import sse_event

_MARK = "\x00replaylm-chunk-text\x00"  # no text a tokenizer decodes to


class ChunkFrames:
    """`empty`: a chunk of the stream with `choices=[]` and nothing optional set;
    `text_choice(index, text)`: the model of a choice carrying `text` alone (a module-level
    function: its templates are cut once per process, not per stream)."""

    def __init__(self, empty: BaseModel, text_choice: Callable[[int, str], BaseModel]) -> None:
        head, tail = _split(empty.model_dump_json(), '"choices":[]')
        self._head, self._tail = head + '"choices":[', "]" + tail
        self._text_choice = text_choice
        opens, closes = _split(sse_event(_MARK).decode(), _MARK)
        self._event_head, self._event_tail = opens + self._head, self._tail + closes

    def text(self, index: int, text: str) -> str:
        """The chunk of choice `index` carrying `text` alone, as JSON."""
        before, after = _choice_around(self._text_choice, index)
        return f"{self._head}{before}{encode_basestring(text)}{after}{self._tail}"

    def event(self, index: int, text: str) -> bytes:
        """`text(index, text)` as the server-sent event a stream sends (`sse_event`'s), in one
        formatting."""
        before, after = _choice_around(self._text_choice, index)
        event = f"{self._event_head}{before}{encode_basestring(text)}{after}{self._event_tail}"
        return event.encode()


@functools.cache
def _choice_around(text_choice: Callable[[int, str], BaseModel], index: int) -> tuple[str, str]:
    """The JSON of `text_choice(index, ...)` around its text."""
    return _split(text_choice(index, _MARK).model_dump_json(), json.dumps(_MARK))


def _split(text: str, at: str) -> tuple[str, str]:
    before, found, after = text.partition(at)
    assert found, f"{at!r} is not in {text!r}"
    return before, after
