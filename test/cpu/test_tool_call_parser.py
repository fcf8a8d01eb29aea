"""The tool-call parser on hand-written model outputs; streamed at every split point."""

from __future__ import annotations

import json

import pytest

from replaylm.entrypoints.tool_call_parser import (
    ParsedOutput,
    ToolCallParser,
    ToolFormat,
    collect,
)

TAGGED, JSON_CALLS = ToolFormat.TAGGED, ToolFormat.JSON
NAMES = ("get_weather", "get_time")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
UNDECLARED = '{"name": "launch", "arguments": {}}'
LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TIME = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
W = ("get_weather", {"city": "Paris"})
T = ("get_time", {"zone": "UTC"})


def block(call: str) -> str:
    return f"<tool_call>\n{call}\n</tool_call>"


# (format, model output, expected content, expected calls as (name, arguments))
CASES = [
    (TAGGED, block(WEATHER), None, [W]),
    (TAGGED, f"{block(WEATHER)}\n{block(TIME)}", None, [W, T]),
    (TAGGED, f"Let me check.\n\n{block(WEATHER)}", "Let me check.", [W]),
    (TAGGED, f"{block(WEATHER)}\nDone.", "Done.", [W]),
    (TAGGED, f"A\n{block(WEATHER)}\nB", "A\nB", [W]),
    (TAGGED, "No tools needed: 2 + 2 = 4.\n", "No tools needed: 2 + 2 = 4.\n", []),
    (
        TAGGED,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        [],
    ),
    (
        TAGGED,
        block(UNDECLARED),
        block(UNDECLARED),
        [],
    ),
    (
        TAGGED,
        f"{block(WEATHER)}\n{block(UNDECLARED)}",
        block(UNDECLARED),
        [W],
    ),
    (TAGGED, f"<tool_call>\n{WEATHER}", None, [W]),  # stopped before the closing tag
    (
        TAGGED,
        '<tool_call>\n{"name": "get_weather", "argu',
        '<tool_call>\n{"name": "get_weather", "argu',
        [],
    ),  # cut off mid-call
    (TAGGED, "a <tool_ b < c", "a <tool_ b < c", []),
    (
        TAGGED,
        block('{"name": "get_weather", "arguments": "Paris"}'),
        block('{"name": "get_weather", "arguments": "Paris"}'),
        [],
    ),
    (JSON_CALLS, LLAMA_WEATHER, None, [W]),
    (JSON_CALLS, f"<|python_tag|>{LLAMA_WEATHER}", None, [W]),
    (JSON_CALLS, f"{LLAMA_WEATHER}; {LLAMA_TIME}", None, [W, T]),
    (JSON_CALLS, f"Checking the weather.\n{LLAMA_WEATHER}", "Checking the weather.", [W]),
    (JSON_CALLS, WEATHER, None, [W]),  # "arguments" is taken for "parameters"
    (
        JSON_CALLS,
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {"city": "Par',
        [],
    ),  # cut off mid-call
    (
        JSON_CALLS,
        '{"name": "get_weather", "parameters": {"city": "}{"}}',
        None,
        [("get_weather", {"city": "}{"})],
    ),
    (
        JSON_CALLS,
        '{"name": "rm", "parameters": {"path": "/"}}',
        '{"name": "rm", "parameters": {"path": "/"}}',
        [],
    ),
    (JSON_CALLS, 'Use {"a": 1} or { "name" : "x" }.', 'Use {"a": 1} or { "name" : "x" }.', []),
    (
        JSON_CALLS,
        '{"name": "get_weather", "parameters": {}, "extra": 1}',
        '{"name": "get_weather", "parameters": {}, "extra": 1}',
        [],
    ),
    (JSON_CALLS, "It is sunny {", "It is sunny {", []),
]


def simple(parsed: ParsedOutput) -> tuple[str | None, list[tuple[str, dict]]]:
    calls = []
    for call in parsed.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return parsed.content, calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_text(fmt: ToolFormat, text: str, content: str | None, calls: list) -> None:
    assert simple(ToolCallParser.parse(text, fmt, NAMES)) == (content, calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_stream_at_every_split_equals_whole_text(
    fmt: ToolFormat, text: str, content: str | None, calls: list
) -> None:
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        parser = ToolCallParser(fmt, NAMES)
        deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
        assert simple(collect(deltas)) == (content, calls), pieces


def test_call_deltas_come_head_first_then_arguments() -> None:
    parser = ToolCallParser(TAGGED, NAMES)
    deltas = parser.feed(f"Hi {block(WEATHER)}") + parser.finish()
    head, args = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert deltas[0] == {"content": "Hi"}
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}


def test_content_streams_at_once_and_only_a_possible_opener_is_held() -> None:
    parser = ToolCallParser(TAGGED, NAMES)
    assert parser.feed("The weather") == [{"content": "The weather"}]
    assert parser.feed(" is <tool") == [{"content": " is"}]  # "<tool" may open a call
    assert parser.feed("s> here") == [{"content": " <tools> here"}]
    json_parser = ToolCallParser(JSON_CALLS, NAMES)
    assert json_parser.feed('x = {"na') == [{"content": "x ="}]
    assert json_parser.feed('me": "get_weather", ') == []  # a call opened: held until it closes
    assert json_parser.feed('"parameters": 1}') == [
        {"content": ' {"name": "get_weather", "parameters": 1}'}
    ]  # no call after all


def test_without_parallel_calls_only_the_first_call_counts() -> None:
    parsed = ToolCallParser.parse(f"{block(WEATHER)}\n{block(TIME)}", TAGGED, NAMES, max_calls=1)
    assert simple(parsed) == (None, [W])


def test_call_ids_differ() -> None:
    parsed = ToolCallParser.parse(f"{LLAMA_WEATHER}; {LLAMA_WEATHER}", JSON_CALLS, NAMES)
    assert len({call["id"] for call in parsed.tool_calls}) == 2
