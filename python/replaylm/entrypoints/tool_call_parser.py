"""Tool calls in a model's output text, parsed incrementally for streams and whole for answers.

Two call syntaxes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen2.5,
Qwen3, Hermes) and bare JSON objects `{"name": ..., "parameters": {...}}` (Llama 3.x, after an
optional `<|python_tag|>`; several separated by `;`), which the fallback prompt asks for too.

A call counts when its JSON is an object with a declared `name` and an `arguments` (or
`parameters`) object; anything else, undeclared names and broken JSON included, stays content.
A call is emitted once it is complete (checked), as two deltas: index, id, type and name, then
its arguments; text that may still open a call is held back until it is decided. Whitespace
around calls (and `;` between JSON calls) is not content. `parse` is the incremental parser fed
the whole text at once, so a stream's concatenated deltas always equal the whole-text answer.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_JSON_CALL_START = re.compile(r'\{\s*"name"\s*:')
_ARGUMENT_KEYS = ("arguments", "parameters")

Delta = dict[str, Any]  # an OpenAI `delta`: {"content": str} or {"tool_calls": [one entry]}


class ToolFormat(enum.Enum):
    """How a served model writes tool calls."""

    TAGGED = "tagged"  # <tool_call> blocks: Qwen2.5, Qwen3, Hermes
    JSON = "json"  # Llama 3.x JSON calls
    FALLBACK = "fallback"  # no tool support in the template: a system prompt asks for JSON calls


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ParsedOutput:
    """A message's `content` (None when empty) and its OpenAI `tool_calls`."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _json_object_end(text: str, state: list[Any]) -> int:
    """Index just past the JSON object that `text` opens with, or -1 while it is open.

    `state` ([next index, depth, in string, escaped]) carries the scan between calls on growing
    text, so a long call is scanned once.
    """
    pos, depth, in_str, esc = state
    while pos < len(text):
        ch = text[pos]
        pos += 1
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return pos
    state[:] = [pos, depth, in_str, esc]
    return -1


def _may_open_json_call(tail: str) -> bool:
    """Whether `tail` (starting at a `{`) could grow into the start of a JSON call."""
    rest = tail[1:].lstrip()
    if len(rest) <= len('"name"'):
        return '"name"'.startswith(rest)
    return rest.startswith('"name"') and not rest[len('"name"') :].strip()


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """`feed(text delta) -> deltas`, then `finish() -> deltas` once the output is complete.

    `names`: the declared functions; `max_calls` (1 without parallel calls): calls past it are
    dropped.
    """

    def __init__(
        self, fmt: ToolFormat, names: Collection[str], max_calls: int | None = None
    ) -> None:
        self._tagged = fmt is ToolFormat.TAGGED
        self._names = frozenset(names)
        self._max_calls = max_calls
        self._buf = ""  # text not decided yet
        self._in_call = False  # _buf opens a call
        self._scan: list[Any] = [0, 0, False, False]
        self._ws = ""  # whitespace after the last content, emitted only if content follows
        self._after_call = False  # drop separators until content
        self._content_out = False
        self._calls = 0
        self._seen_call = False

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        self._advance(out, final=False)
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        self._advance(out, final=True)
        if self._in_call:  # unclosed: a complete call only where the format needs no end
            self._close_call(self._buf, out)
        self._buf = ""
        if not self._seen_call and self._ws:
            out.append({"content": self._ws})
        return out

    @classmethod
    def parse(
        cls, text: str, fmt: ToolFormat, names: Collection[str], max_calls: int | None = None
    ) -> ParsedOutput:
        """The whole output `text` as content and tool calls."""
        parser = cls(fmt, names, max_calls)
        return collect(parser.feed(text) + parser.finish())

    def _advance(self, out: list[Delta], final: bool) -> None:
        while self._buf:
            if self._in_call:
                end = self._call_end()
                if end < 0:
                    return
                block, self._buf = self._buf[:end], self._buf[end:]
                self._close_call(block, out)
                continue
            if self._after_call:
                seps = " \t\r\n" if self._tagged else " \t\r\n;"
                self._buf = self._buf.lstrip(seps)
                if not self._buf:
                    return
                self._after_call = False
            start, skip = self._call_start()
            if start < 0:
                keep = 0 if final else self._held()
                self._content(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return
            self._content(self._buf[:start], out)
            self._buf = self._buf[start + skip :]
            if not skip:  # a python tag is dropped; anything else opens a call
                self._in_call = True
                self._scan = [0, 0, False, False]

    def _call_start(self) -> tuple[int, int]:
        """(index of the next call opener or -1, length of a marker to drop there, else 0)."""
        if self._tagged:
            return self._buf.find(TOOL_CALL_OPEN), 0
        tag = self._buf.find(PYTHON_TAG)
        match = _JSON_CALL_START.search(self._buf)
        if match is not None and (tag < 0 or match.start() < tag):
            return match.start(), 0
        return tag, len(PYTHON_TAG) if tag >= 0 else 0

    def _held(self) -> int:
        """How much of the end of `_buf` may still open a call (held back from content)."""
        if self._tagged:
            return _prefix_overlap(self._buf, TOOL_CALL_OPEN)
        brace = self._buf.rfind("{")
        held = (
            len(self._buf) - brace if brace >= 0 and _may_open_json_call(self._buf[brace:]) else 0
        )
        return max(held, _prefix_overlap(self._buf, PYTHON_TAG))

    def _call_end(self) -> int:
        if not self._tagged:
            return _json_object_end(self._buf, self._scan)
        end = self._buf.find(TOOL_CALL_CLOSE, len(TOOL_CALL_OPEN))
        return end + len(TOOL_CALL_CLOSE) if end >= 0 else -1

    def _close_call(self, block: str, out: list[Delta]) -> None:
        self._in_call = False
        body = block
        if self._tagged:
            body = block[len(TOOL_CALL_OPEN) :]
            body = body[: -len(TOOL_CALL_CLOSE)] if body.endswith(TOOL_CALL_CLOSE) else body
        call = self._call(body)
        if call is None:
            self._content(block, out)
            return
        self._seen_call, self._after_call = True, True
        if self._max_calls is not None and self._calls >= self._max_calls:
            return
        name, arguments = call
        head = {"index": self._calls, "id": new_call_id(), "type": "function"}
        out.append({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": self._calls, "function": {"arguments": arguments}}]})
        self._calls += 1

    def _call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of a call's JSON text; None when it is no valid call."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self._names:
            return None
        args = [k for k in _ARGUMENT_KEYS if k in obj]
        if len(args) != 1 or len(obj) != 2 or not isinstance(obj[args[0]], dict):
            return None
        return obj["name"], json.dumps(obj[args[0]], ensure_ascii=False)

    def _content(self, text: str, out: list[Delta]) -> None:
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        # whitespace before a call is kept only between two pieces of content
        lead = self._ws if self._content_out or not self._seen_call else ""
        self._ws = text[len(body) :]
        self._content_out = True
        out.append({"content": lead + body})


def collect(deltas: list[Delta]) -> ParsedOutput:
    """The message that a client assembles from `deltas` (OpenAI's accumulation rules)."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for entry in delta.get("tool_calls", []):
            if entry["index"] == len(calls):
                calls.append({"id": entry["id"], "type": entry["type"]})
                calls[-1]["function"] = {"name": entry["function"]["name"], "arguments": ""}
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return ParsedOutput(content or None, calls)
