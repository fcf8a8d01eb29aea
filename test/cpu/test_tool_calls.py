"""Tool calls for the chat route: request checks, format detection, rendering through real chat
templates (SmolLM2's, and the Qwen- and Llama-style fixtures), and the forcing constraint through
the real grammar engine against the built-in model's vocabulary."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from replaylm.entrypoints.tool_call_parser import ToolFormat
from replaylm.entrypoints.tool_calls import (
    ChatTools,
    ToolRequest,
    detect_tool_format,
    tool_request,
)
from replaylm.model_loader.tokenizer import chat_input_ids, load_tokenizer
from replaylm.runtime.errors import RequestError
from replaylm.structured.vocabulary import describe_vocabulary

from tool_schemas import WEATHER_SCHEMA

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_tokenizer("smollm2-135m-instruct")


def with_template(tokenizer: Any, name: str) -> Any:
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (TEMPLATES / name).read_text()
    return tokenizer


def rendered(tokenizer: Any, messages: list[dict], request: ToolRequest | None) -> str:
    """The prompt text of `messages` with `request`'s tools, as the chat route renders it."""
    messages, offered = ChatTools(tokenizer).prompt(messages, request)
    return tokenizer.decode(chat_input_ids(tokenizer, messages, tools=offered))


# ---- the request's tool settings ----------------------------------------------------------


def test_no_tools_and_choice_none_offer_nothing() -> None:
    assert tool_request(None, None, None) is None
    assert tool_request([], "none", None) is None
    assert tool_request([], "auto", False) is None
    assert tool_request(TOOLS, "none", True) is None


def test_choices() -> None:
    auto = tool_request(TOOLS, None, None)
    assert auto is not None and not auto.required and auto.function is None and auto.parallel
    assert auto.names == ["get_weather", "get_time"]
    required = tool_request(TOOLS, "required", False)
    assert required is not None and required.required and not required.parallel
    named = tool_request(TOOLS, NAMED, None)
    assert named is not None and named.function == "get_weather"


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param"),
    [
        ({"type": "function"}, None, None, "tools"),
        ([{"type": "code_interpreter"}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, None, "tools"),
        (TOOLS + TOOLS[:1], None, None, "tools"),
        (TOOLS, "sometimes", None, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "launch"}}, None, "tool_choice"),
        (TOOLS, {"type": "function"}, None, "tool_choice"),
        ([], "required", None, "tool_choice"),
        (None, NAMED, None, "tool_choice"),
        (TOOLS, "auto", "yes", "parallel_tool_calls"),
    ],
)
def test_bad_tool_settings_name_their_field(
    tools: Any, choice: Any, parallel: Any, param: str
) -> None:
    with pytest.raises(RequestError) as err:
        tool_request(tools, choice, parallel)
    assert err.value.param == param


# ---- which format, from the chat template ---------------------------------------------------


def test_formats_from_chat_templates(smollm2: Any) -> None:
    assert detect_tool_format(smollm2.chat_template)[0] is ToolFormat.FALLBACK
    assert detect_tool_format(None)[0] is ToolFormat.FALLBACK
    qwen = (TEMPLATES / "qwen_tool_call.jinja").read_text()
    assert detect_tool_format(qwen)[0] is ToolFormat.TAGGED
    assert detect_tool_format({"default": "x", "tool_use": qwen})[0] is ToolFormat.TAGGED
    llama = (TEMPLATES / "llama3_json.jinja").read_text()
    assert detect_tool_format(llama)[0] is ToolFormat.JSON


def test_the_format_is_logged_once_with_its_reason(smollm2: Any, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="replaylm.entrypoints.tool_calls"):
        tools = ChatTools(smollm2)
        tools.prompt(CONVERSATION, tool_request(TOOLS, None, None))
    assert [r.getMessage() for r in caplog.records] == [
        "tool calls use the fallback prompt and JSON calls: the chat template takes no tools"
    ]


# ---- rendering --------------------------------------------------------------------------------


def test_fallback_prompt_calls_and_results_as_text(smollm2: Any) -> None:
    text = rendered(smollm2, CONVERSATION, tool_request(TOOLS, None, None))
    assert text.startswith("<|im_start|>system\nYou can call these functions:\n")
    assert json.dumps(TOOLS[0]["function"]) in text
    assert '{"name": <function name>, "parameters": <its arguments' in text
    assert (
        '<|im_start|>assistant\n{"name": "get_weather", "parameters": '
        '{"city": "Paris", "unit": "celsius"}}<|im_end|>' in text
    )
    assert "<|im_start|>user\nget_weather returned: 18 C, sunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_fallback_keeps_the_system_message_and_adds_the_tools(smollm2: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    text = rendered(smollm2, messages, tool_request(TOOLS, "required", None))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions:")


def test_fallback_results_of_one_round_share_a_user_message(smollm2: Any) -> None:
    second = {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, second]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    text = rendered(smollm2, messages, None)
    assert "You can call" not in text  # no tools offered
    assert '\nChecking.\n{"name": "get_weather", "parameters": {"city": "Paris"' in text
    assert '; {"name": "get_time", "parameters": {}}<|im_end|>' in text
    assert "<|im_start|>user\nget_weather returned: 18 C\nget_time returned: noon<|im_end|>" in text


def test_without_tools_the_prompt_is_the_plain_chat_prompt(smollm2: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatTools(smollm2).prompt(messages, None) == (messages, None)


def test_qwen_style_template_gets_tools_calls_and_results(smollm2: Any) -> None:
    qwen = with_template(smollm2, "qwen_tool_call.jinja")
    assert ChatTools(qwen).format is ToolFormat.TAGGED
    text = rendered(qwen, CONVERSATION, tool_request(TOOLS, None, None))
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text
    # arguments reach the template as an object, written as JSON (not as a quoted string)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call><|im_end|>" in text
    )
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    none = rendered(qwen, CONVERSATION, tool_request(TOOLS, "none", None))
    assert "<tools>" not in none and "<tool_response>" in none


def test_llama_style_template_gets_tools_calls_and_results(smollm2: Any) -> None:
    llama = with_template(smollm2, "llama3_json.jinja")
    assert ChatTools(llama).format is ToolFormat.JSON
    text = rendered(llama, CONVERSATION, tool_request(TOOLS, NAMED, None))
    assert "Environment: ipython" in text and json.dumps(TOOLS[1], indent=4) in text
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>' in text
    )
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "18 C, sunny"}' in text


# ---- forcing calls: the structural tag through the grammar engine -----------------------------


@pytest.fixture(scope="module")
def compiler(smollm2: Any) -> xgr.GrammarCompiler:
    description = describe_vocabulary(smollm2)
    assert description is not None
    return xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(description))


def accepts(grammar: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def forced_tools(smollm2: Any, fmt: ToolFormat) -> ChatTools:
    if fmt is ToolFormat.FALLBACK:
        return ChatTools(smollm2)
    name = "qwen_tool_call.jinja" if fmt is ToolFormat.TAGGED else "llama3_json.jinja"
    return ChatTools(with_template(smollm2, name))


def calls_text(fmt: ToolFormat, calls: list[tuple[str, str]]) -> str:
    if fmt is ToolFormat.TAGGED:
        return "\n".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls
        )
    return "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)


PARIS = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
UTC = ("get_time", '{"zone": "UTC"}')


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_no_constraint_for_auto_and_none(smollm2: Any, fmt: ToolFormat) -> None:
    tools = forced_tools(smollm2, fmt)
    assert tools.structural_tag(tool_request(TOOLS, "auto", None)) is None
    assert tools.structural_tag(tool_request(TOOLS, "none", None)) is None


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_named_function_forces_exactly_that_call(
    smollm2: Any, compiler: xgr.GrammarCompiler, fmt: ToolFormat
) -> None:
    tools = forced_tools(smollm2, fmt)
    request = tool_request(TOOLS, NAMED, None)
    assert request is not None
    tag = tools.structural_tag(request)
    assert tag is not None
    grammar = compiler.compile_structural_tag(tag)
    good = calls_text(fmt, [PARIS])
    assert accepts(grammar, good)
    parsed = tools.parse(good, request)
    assert parsed.content is None and [c["function"]["name"] for c in parsed.tool_calls] == [
        "get_weather"
    ]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == json.loads(PARIS[1])
    for bad in (
        calls_text(fmt, [UTC]),  # another function
        calls_text(fmt, [("get_weather", '{"city": "Paris"}')]),  # a required argument missing
        calls_text(fmt, [("get_weather", '{"city": "Paris", "unit": "kelvin"}')]),
        calls_text(fmt, [PARIS, PARIS]),  # a second call
        "Sure! " + good,  # text before the call
        good[:-1],  # unfinished
    ):
        assert not accepts(grammar, bad), bad


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_required_forces_calls_to_declared_functions(
    smollm2: Any, compiler: xgr.GrammarCompiler, fmt: ToolFormat
) -> None:
    tools = forced_tools(smollm2, fmt)
    parallel = tool_request(TOOLS, "required", None)
    single = tool_request(TOOLS, "required", False)
    assert parallel is not None and single is not None
    parallel_tag, single_tag = tools.structural_tag(parallel), tools.structural_tag(single)
    assert parallel_tag is not None and single_tag is not None
    many, one = (
        compiler.compile_structural_tag(parallel_tag),
        compiler.compile_structural_tag(single_tag),
    )
    two_calls = calls_text(fmt, [PARIS, UTC])
    assert accepts(many, two_calls) and not accepts(one, two_calls)
    parsed = tools.parse(two_calls, parallel)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    for grammar in (many, one):
        assert accepts(grammar, calls_text(fmt, [UTC]))
        assert not accepts(grammar, "")  # at least one call
        assert not accepts(grammar, "It is sunny.")
        assert not accepts(grammar, calls_text(fmt, [("launch", "{}")]))
