"""Forced tool calls from the real built-in model (SmolLM2-135M-Instruct, which has no tool
support of its own: the fallback prompt) through the Engine and its grammar engine."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from replaylm.entrypoints.engine import Engine
from replaylm.entrypoints.tool_calls import ChatTools, tool_request
from replaylm.model_loader.tokenizer import chat_input_ids

from tool_schemas import SCHEMAS

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", max_total_tokens=4096, max_running_requests=4)


def forced_calls(engine: Engine, choice: Any, parallel: bool) -> list[dict[str, Any]]:
    tools = ChatTools(engine.tokenizer)
    request = tool_request(TOOLS, choice, parallel)
    assert request is not None
    params = {"max_new_tokens": 96, "temperature": 0.0}
    params["structural_tag"] = tools.structural_tag(request)
    messages, offered = tools.prompt(QUESTION, request)
    ids = chat_input_ids(engine.tokenizer, messages, tools=offered)
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]  # the call ended
    parsed = tools.parse(out["text"], request)
    assert parsed.content is None, out["text"]
    return parsed.tool_calls


def check_calls(calls: list[dict[str, Any]]) -> None:
    for call in calls:
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_a_named_function_is_called(engine: Engine) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    calls = forced_calls(engine, choice, parallel=True)
    assert [call["function"]["name"] for call in calls] == ["get_time"]
    check_calls(calls)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_a_declared_function(engine: Engine, parallel: bool) -> None:
    calls = forced_calls(engine, "required", parallel)
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    assert calls[0]["function"]["name"] == "get_weather"  # the question's function
    check_calls(calls)
