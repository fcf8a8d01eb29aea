"""`/v1/responses` (OpenAI's Responses API) against a real server (the built-in SmolLM2 on CPU,
conftest.py's `http_server`) with the official `openai` client and httpx: answers equal the
chat route's for the same conversation, instructions and input items reach the prompt,
structured output, forced function calls and their outputs fed back through
`previous_response_id`, the store, `max_output_tokens`, the stream's events, refused fields.
Greedy decoding throughout, so outputs are comparable."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from replaylm.entrypoints.responses_output import ResponseObject
from replaylm.entrypoints.responses_store import ResponseStore, StoredResponse

from http_helpers import CHAT, CONTEXT_LEN, MODEL
from tool_schemas import WEATHER_SCHEMA

GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 16}
QUESTION = "What is the weather like in Paris?"
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "get_weather",
        "parameters": WEATHER_SCHEMA,
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "get_weather",
            "parameters": WEATHER_SCHEMA,
        },
    }
]
FORCED: dict[str, Any] = {
    "tools": TOOLS,
    "tool_choice": {"type": "function", "name": "get_weather"},
    "max_output_tokens": 48,  # a call takes about 25
}
ANSWER = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 12}},
    "required": ["colour"],
    "additionalProperties": False,
}


def prompt_tokens(http: httpx.Client, messages: list[Any], tools: Any = None) -> int:
    """How many tokens the chat route's prompt of `messages` has."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if tools is not None:
        body["tools"] = tools
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_a_text_answer_is_the_chat_answer(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16)
    reply = client.responses.create(**GREEDY, input=CHAT[0]["content"])
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.model == MODEL and reply.status in ("completed", "incomplete")
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == reply.status
    [part] = message.content
    assert part.type == "output_text" and part.text.strip()
    assert part.text == chat.choices[0].message.content
    usage, chat_usage = reply.usage, chat.usage
    assert usage is not None and chat_usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (
        chat_usage.prompt_tokens,
        chat_usage.completion_tokens,
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the chat's prompt again: all of it but its last token comes from the prefix cache
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1


def test_instructions_and_input_items_make_the_prompt(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Blue."}],
        },
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Another one?"},
    ]
    reply = client.responses.create(**GREEDY, instructions="You are terse.", input=items)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Another one?"},
    ]
    assert reply.usage is not None
    assert reply.usage.input_tokens == prompt_tokens(http, messages)
    assert reply.instructions == "You are terse." and reply.output_text.strip()


def test_a_json_schema_format_gives_valid_json(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    reply = client.responses.create(
        **{**GREEDY, "max_output_tokens": 64}, input="Name a colour.", text={"format": fmt}
    )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), ANSWER)
    assert reply.text is not None and reply.text.format.type == "json_schema"


def _only_call(reply: Any) -> Any:
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    return call


def test_a_forced_call_and_its_output_continue_the_conversation(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    first = client.responses.create(**{**GREEDY, **FORCED}, input=QUESTION)
    call = _only_call(first)
    assert first.status == "completed"
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    second = client.responses.create(
        **GREEDY, tools=TOOLS, input=[result], previous_response_id=first.id
    )
    assert second.previous_response_id == first.id and second.output
    # the earlier input and output and the call's output open the prompt, as in a chat
    tool_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.arguments},
    }
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == prompt_tokens(http, messages, CHAT_TOOLS)


def test_stored_responses_are_retrieved_and_deleted(client: openai.OpenAI) -> None:
    stored = client.responses.create(**{**GREEDY, "max_output_tokens": 2}, input="Hi")
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    unstored = client.responses.create(
        **{**GREEDY, "max_output_tokens": 2}, input="Hi", store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("known", [False, True])
def test_an_unknown_previous_response_id_is_refused(client: openai.OpenAI, known: bool) -> None:
    short = {**GREEDY, "max_output_tokens": 2}
    previous = "resp_unknown"
    if known:  # an id the server gave but did not store
        previous = client.responses.create(**short, input="Hi", store=False).id
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**short, input="Hi", previous_response_id=previous)
    assert err.value.param == "previous_response_id" and previous in err.value.message


def test_the_store_drops_its_oldest_past_capacity() -> None:
    store = ResponseStore(capacity=2)
    ids = ["resp_a", "resp_b", "resp_c"]
    for rid in ids:
        store.put(StoredResponse(ResponseObject.model_construct(id=rid), []))
    assert [store.get(rid) is not None for rid in ids] == [False, True, True]


def test_max_output_tokens_leaves_the_response_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(**{**GREEDY, "max_output_tokens": 3}, input=QUESTION)
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and reply.usage.output_tokens == 3
    assert reply.output[0].status == "incomplete"


def _events(client: openai.OpenAI, **request: Any) -> list[Any]:
    events = list(client.responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_stream_sends_the_events_in_order_and_its_deltas_make_the_text(
    client: openai.OpenAI,
) -> None:
    events = _events(client, **GREEDY, input=QUESTION)
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # really streamed, not one blob
    opening = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    closing = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    last = (
        "response.completed" if events[-1].response.status == "completed" else "response.incomplete"
    )
    expected = opening + ["response.output_text.delta"] * len(deltas) + closing + [last]
    assert types == expected
    done = events[-1].response
    text = "".join(deltas)
    assert text == events[-4].text == done.output[0].content[0].text
    whole = client.responses.create(**GREEDY, input=QUESTION)
    assert text == whole.output_text and done.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(done.id).output_text == text  # stored once complete


def test_a_streamed_call_sends_its_arguments(client: openai.OpenAI) -> None:
    events = _events(client, **{**GREEDY, **FORCED}, input=QUESTION)
    types = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(pieces),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = _only_call(events[-1].response)
    assert "".join(pieces) == events[-3].arguments == call.arguments
    assert events[2].item.name == "get_weather" and events[2].item.call_id == call.call_id


def test_stream_events_are_named(http: httpx.Client) -> None:
    body = {**GREEDY, "max_output_tokens": 3, "input": "Hi", "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        blocks = response.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert json.loads(blocks[-1].split("data: ")[1])["type"] == "response.incomplete"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
        ({"background": True}, "background"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": 3}}}}, "text.format"),
        ({"max_output_tokens": CONTEXT_LEN * 2}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/responses", json={**GREEDY, "input": "Hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and error["type"] == "invalid_request_error"


def test_fields_without_effect_are_accepted(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        **{**GREEDY, "max_output_tokens": 2},
        input="Hi",
        metadata={"k": "v"},
        user="u",
        parallel_tool_calls=False,
        truncation="disabled",
        reasoning={},
    )
    assert reply.metadata == {"k": "v"} and reply.parallel_tool_calls is False
