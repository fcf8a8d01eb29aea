"""Tool calls over the API with the official `openai` client, against a real server (the built-in
SmolLM2 on CPU, conftest.py's `http_server`; its template has no tool support, so the fallback
prompt): forced calls parse and name a declared function with valid arguments, a stream's deltas
assemble into the non-stream answer, tool results in the conversation reach the prompt."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from http_helpers import MODEL
from tool_schemas import SCHEMAS

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 48}  # a call takes about 25


def calls_of(message: Any) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, checked against its function's schema."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def streamed(client: openai.OpenAI, **request: Any) -> tuple[str | None, list, str | None]:
    """(content, [(name, arguments)], finish_reason) assembled from a stream's deltas."""
    content, calls, reason = "", [], None
    ids: list[str] = []
    for chunk in client.chat.completions.create(**{**GREEDY, **request}, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.index == len(calls):  # a new call: id, type and name first
                assert call.id and call.type == "function" and call.function.name
                ids.append(call.id)
                calls.append([call.function.name, ""])
            calls[call.index][1] += call.function.arguments or ""
        reason = choice.finish_reason or reason
    assert len(set(ids)) == len(ids)
    return content or None, [(n, json.loads(a)) for n, a in calls], reason


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        **GREEDY, messages=QUESTION, tools=TOOLS, tool_choice=choice
    )
    message = reply.choices[0].message
    assert message.content is None
    assert [name for name, _ in calls_of(message)] == ["get_weather"]
    assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_stream_as_the_whole_answer(client: openai.OpenAI, parallel: bool) -> None:
    request: Any = {
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
    }
    reply = client.chat.completions.create(**GREEDY, **request)
    message = reply.choices[0].message
    calls = calls_of(message)
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert streamed(client, **request) == (message.content, calls, "tool_calls")


def test_auto_stream_equals_the_whole_answer(client: openai.OpenAI) -> None:
    request: Any = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 24}
    reply = client.chat.completions.create(**{**GREEDY, **request})
    message = reply.choices[0].message
    whole = (message.content, calls_of(message), reply.choices[0].finish_reason)
    assert streamed(client, **request) == whole


def test_tool_results_reach_the_prompt(client: openai.OpenAI, http: httpx.Client) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages: Any = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    response = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    prompt = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "get_weather returned: 18 C and sunny" in prompt
    assert "You can call these functions" in prompt
    reply = client.chat.completions.create(
        **{**GREEDY, "max_tokens": 4}, messages=messages, tools=TOOLS
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(tokens)
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls


def test_tool_choice_none_offers_no_tools(client: openai.OpenAI) -> None:
    short = {**GREEDY, "max_tokens": 8}
    plain = client.chat.completions.create(**short, messages=QUESTION)
    none = client.chat.completions.create(
        **short, messages=QUESTION, tools=TOOLS, tool_choice="none"
    )
    assert none.usage is not None and plain.usage is not None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
