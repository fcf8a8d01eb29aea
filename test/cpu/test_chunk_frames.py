"""A stream chunk filled from `ChunkFrames` equals the one the response models would dump (and
its event the one a stream frames), for completions and chat, whatever the text (quotes,
escapes, control characters, non-ASCII) and the choice's index."""

from __future__ import annotations

import json

import pytest

from replaylm.entrypoints.chunk_frames import ChunkFrames
from replaylm.entrypoints.http_streaming import sse_event
from replaylm.entrypoints.openai_responses import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)

TEXTS = [
    "",
    " hello",
    'say "hi"',
    "back\\slash",
    "line\nbreak\ttab\r",
    "\x00\x1f\x7f",
    "héllo 世界 🎉",
]
HEAD = {"id": "cmpl-1", "created": 1_700_000_000, "model": "m", "system_fingerprint": "fp"}


def _completion(choices: list[CompletionChoice]) -> CompletionResponse:
    return CompletionResponse(**HEAD, choices=choices)


def _chat(choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
    return ChatCompletionChunk(**HEAD, choices=choices)


def _chat_choice(index: int, text: str) -> ChatStreamChoice:
    return ChatStreamChoice(index=index, delta=DeltaMessage(content=text))


def _completion_choice(index: int, text: str) -> CompletionChoice:
    return CompletionChoice(index=index, text=text)


@pytest.mark.parametrize(
    ("chunk", "choice"), [(_completion, _completion_choice), (_chat, _chat_choice)]
)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 3])
def test_a_text_chunk_is_what_the_model_dumps(chunk, choice, text, index):
    frames = ChunkFrames(chunk([]), choice)
    filled = frames.text(index, text)
    expected = chunk([choice(index, text)]).model_dump_json()
    assert filled == expected
    assert json.loads(filled)["choices"][0]["index"] == index
    assert frames.event(index, text) == sse_event(expected)
