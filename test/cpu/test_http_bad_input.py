"""Bad input to the real server (conftest.py's `http_server`): every case gets its status and an
OpenAI-style error body naming the field, never a 500, and the server keeps serving."""

from __future__ import annotations

import re

import openai
import pytest

from http_helpers import MODEL

CHAT = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello " * 3000  # ~3000 tokens, over the shared server's context of 2048
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BAD_TOOL = [
    {"type": "function", "function": {"name": "g", "parameters": {"type": "nope"}}},
]


def _completion(**fields) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"messages": CHAT, "max_tokens": 2, **fields}


# (path, body: dict as JSON or raw bytes, status, param, regex the message must match)
CASES = {
    "malformed json": ("/v1/completions", b'{"prompt": "x"', 400, None, "not valid JSON"),
    "empty body": ("/v1/chat/completions", b"", 400, None, "not valid JSON"),
    "body not an object": ("/v1/completions", b"[1, 2]", 400, None, "object"),
    "invalid utf-8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    "lone surrogate escape": ("/v1/completions", b'{"prompt": "\\ud800"}', 400, None, "JSON"),
    "max_tokens as string": (
        "/v1/completions",
        _completion(max_tokens="5"),
        400,
        "max_tokens",
        "integer",
    ),
    "max_tokens zero without echo": (
        "/v1/completions",
        _completion(max_tokens=0),
        400,
        "max_tokens",
        "0 is allowed only with echo",
    ),
    "max_tokens over the context": (
        "/v1/completions",
        _completion(max_tokens=5000),
        400,
        "max_tokens",
        r"^This model's maximum context length is 2048 tokens\. However, you requested 5001 "
        r"tokens \(1 in the prompt, 5000 in the completion\)\. Please reduce the length of the "
        r"prompt or completion\.$",
    ),
    "max_completion_tokens over the context": (
        "/v1/chat/completions",
        _chat(max_completion_tokens=3000),
        400,
        "max_completion_tokens",
        r"maximum context length is 2048 tokens\. However, you requested 30\d\d tokens "
        r"\(\d\d in the messages, 3000 in the completion\)\. Please reduce the length of the "
        r"messages or completion\.",
    ),
    "max_tokens negative": (
        "/v1/chat/completions",
        _chat(max_tokens=-3),
        400,
        "max_tokens",
        "greater than or equal to 1",
    ),
    "max_completion_tokens zero": (
        "/v1/chat/completions",
        _chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
        "greater than or equal to 1",
    ),
    "temperature negative": (
        "/v1/completions",
        _completion(temperature=-0.5),
        400,
        "temperature",
        "greater than or equal to 0",
    ),
    "temperature infinite": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
        400,
        "temperature",
        "finite",
    ),
    "temperature bool": (
        "/v1/completions",
        _completion(temperature=True),
        400,
        "temperature",
        "number",
    ),
    "top_p zero": ("/v1/completions", _completion(top_p=0), 400, "top_p", "greater than 0"),
    "top_p above one": (
        "/v1/chat/completions",
        _chat(top_p=1.5),
        400,
        "top_p",
        "less than or equal to 1",
    ),
    "top_k below -1": ("/v1/completions", _completion(top_k=-2), 400, "top_k", "-1"),
    "min_p above one": ("/v1/completions", _completion(min_p=2), 400, "min_p", "1"),
    "seed below int64": (
        "/v1/completions",
        _completion(seed=-(2**63) - 1),
        400,
        "seed",
        "greater than or equal to -9223372036854775808",
    ),
    "seed above int64": (
        "/v1/chat/completions",
        _chat(seed=2**63),
        400,
        "seed",
        "Input should be less than or equal to 9223372036854775807",
    ),
    "stop wrong type": ("/v1/completions", _completion(stop=5), 400, "stop", "string"),
    "stop empty": (
        "/v1/completions",
        _completion(stop=""),
        400,
        "stop",
        r"^stop cannot contain an empty string\.$",
    ),
    "stop list with an empty string": (
        "/v1/chat/completions",
        _chat(stop=["\n", ""]),
        400,
        "stop",
        "empty string",
    ),
    "stop_token_ids negative": (
        "/v1/completions",
        _completion(stop_token_ids=[-1]),
        400,
        "stop_token_ids[0]",
        "greater than or equal to 0",
    ),
    "stream not a bool": ("/v1/completions", _completion(stream="yes"), 400, "stream", "bool"),
    "stream_options without stream": (
        "/v1/completions",
        _completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
        r"^The 'stream_options' parameter is only allowed when 'stream' is enabled\.$",
    ),
    "stream_options with stream false (chat)": (
        "/v1/chat/completions",
        _chat(stream=False, stream_options={"include_usage": False}),
        400,
        "stream_options",
        "only allowed when 'stream' is enabled",
    ),
    "n zero": ("/v1/completions", _completion(n=0), 400, "n", "greater than or equal to 1"),
    "n above the bound (chat)": (
        "/v1/chat/completions",
        _chat(n=1000),
        400,
        "n",
        r"n must be in \[1, \d+\], got 1000",
    ),
    "n as string": ("/v1/chat/completions", _chat(n="2"), 400, "n", "integer"),
    "best_of above n": ("/v1/completions", _completion(best_of=3), 400, "best_of", "equal n"),
    "suffix": ("/v1/completions", _completion(suffix="end"), 400, "suffix", "not supported"),
    "echo not a bool": ("/v1/completions", _completion(echo="yes"), 400, "echo", "bool"),
    "penalty out of range": (
        "/v1/completions",
        _completion(presence_penalty=3),
        400,
        "presence_penalty",
        "less than or equal to 2",
    ),
    "penalty as string": (
        "/v1/chat/completions",
        _chat(frequency_penalty="0"),
        400,
        "frequency_penalty",
        "number",
    ),
    "repetition_penalty zero": (
        "/v1/completions",
        _completion(repetition_penalty=0),
        400,
        "repetition_penalty",
        "greater than 0",
    ),
    "logit_bias key not a token id": (
        "/v1/completions",
        _completion(logit_bias={"hello": 5}),
        400,
        "logit_bias",
        "token ids",
    ),
    "logit_bias value out of range": (
        "/v1/chat/completions",
        _chat(logit_bias={"5": 101}),
        400,
        "logit_bias",
        "less than or equal to 100",
    ),
    "min_tokens above max_tokens": (
        "/v1/completions",
        _completion(min_tokens=5),
        400,
        "min_tokens",
        "max_new_tokens=2",
    ),
    "response_format json_schema without schema": (
        "/v1/chat/completions",
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema.schema",
        "schema",
    ),
    "response_format unknown type": (
        "/v1/chat/completions",
        _chat(response_format={"type": "xml"}),
        400,
        "response_format.type",
        "'json_schema'",
    ),
    "two constraints": (
        "/v1/completions",
        _completion(regex="a+", json_schema={"type": "object"}),
        400,
        "regex",
        "cannot be combined with json_schema",
    ),
    "response_format with guided_regex": (
        "/v1/chat/completions",
        _chat(
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
            guided_regex="a+",
        ),
        400,
        "guided_regex",
        "guided_regex cannot be combined with response_format",
    ),
    "guided_json with structured_outputs": (
        "/v1/completions",
        _completion(guided_json={"type": "object"}, structured_outputs={"choice": ["a", "b"]}),
        400,
        "structured_outputs.choice",
        "cannot be combined with guided_json",
    ),
    "two constraints in structured_outputs": (
        "/v1/completions",
        _completion(structured_outputs={"regex": "a+", "grammar": 'root ::= "a"'}),
        400,
        "structured_outputs.grammar",
        "cannot be combined with structured_outputs.regex",
    ),
    "structured_outputs with an unknown key": (
        "/v1/completions",
        _completion(structured_outputs={"lark": "start: /a+/"}),
        400,
        "structured_outputs.lark",
        "unsupported parameter",
    ),
    "structured_outputs.choice empty": (
        "/v1/chat/completions",
        _chat(structured_outputs={"choice": []}),
        400,
        "structured_outputs.choice",
        "at least 1",
    ),
    "structured_outputs.disable_any_whitespace": (
        "/v1/chat/completions",
        _chat(structured_outputs={"json_object": True, "disable_any_whitespace": True}),
        400,
        "structured_outputs.disable_any_whitespace",
        "not supported",
    ),
    "structured_outputs.whitespace_pattern": (
        "/v1/completions",
        _completion(structured_outputs={"json": {"type": "object"}, "whitespace_pattern": " ?"}),
        400,
        "structured_outputs.whitespace_pattern",
        "not supported",
    ),
    "guided_regex invalid": (
        "/v1/completions",
        _completion(guided_regex="(a"),
        400,
        "guided_regex",
        r"^guided_regex: invalid regex: .*parenthesis",
    ),
    "guided_json invalid": (
        "/v1/chat/completions",
        _chat(guided_json={"type": 3}),
        400,
        "guided_json",
        r"^guided_json: invalid json_schema: ",
    ),
    "guided_grammar invalid": (
        "/v1/completions",
        _completion(guided_grammar="root ::="),
        400,
        "guided_grammar",
        r"^guided_grammar: invalid ebnf: ",
    ),
    "structured_outputs.json invalid": (
        "/v1/completions",
        _completion(structured_outputs={"json": '{"type": "nope"}'}),
        400,
        "structured_outputs.json",
        r"invalid json_schema: .*nope",
    ),
    "structured_outputs.regex invalid": (
        "/v1/chat/completions",
        _chat(structured_outputs={"regex": "[a-"}),
        400,
        "structured_outputs.regex",
        "invalid regex",
    ),
    "structured_outputs.grammar invalid": (
        "/v1/completions",
        _completion(structured_outputs={"grammar": "root ::= undefined_rule"}),
        400,
        "structured_outputs.grammar",
        "invalid ebnf",
    ),
    "structured_outputs.structural_tag invalid": (
        "/v1/completions",
        _completion(structured_outputs={"structural_tag": '{"type": "structural_tag"}'}),
        400,
        "structured_outputs.structural_tag",
        "invalid structural_tag: .*format",
    ),
    "response_format with an invalid schema": (
        "/v1/chat/completions",
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}}),
        400,
        "response_format.json_schema.schema",
        "invalid json_schema",
    ),
    "guided_whitespace_pattern": (
        "/v1/completions",
        _completion(guided_json={"type": "object"}, guided_whitespace_pattern=" ?"),
        400,
        "guided_whitespace_pattern",
        "not supported",
    ),
    "prompt_logprobs with stream": (
        "/v1/completions",
        _completion(prompt_logprobs=1, stream=True),
        400,
        "prompt_logprobs",
        "stream",
    ),
    "a tool's name out of OpenAI's characters": (
        "/v1/chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
        400,
        "tools",
        "letters, digits",
    ),
    "a forced tool call with a response format": (
        "/v1/chat/completions",
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
            response_format={"type": "json_object"},
        ),
        400,
        "tool_choice",
        "cannot be combined",
    ),
    "a forced tool call with guided_regex": (
        "/v1/chat/completions",
        _chat(tools=TOOLS, tool_choice="required", guided_regex="a+"),
        400,
        "tool_choice",
        "cannot be combined with guided_regex",
    ),
    "a bad tool schema under tool_choice required": (
        "/v1/chat/completions",
        _chat(tools=TOOLS + BAD_TOOL, tool_choice="required"),
        400,
        "tools[1].function.parameters",
        r"^tools\[1\]\.function\.parameters is not a valid JSON schema: .*nope",
    ),
    "a bad tool schema under tool_choice auto": (
        "/v1/chat/completions",
        _chat(tools=BAD_TOOL + TOOLS, tool_choice="auto"),
        400,
        "tools[0].function.parameters",
        "not a valid JSON schema",
    ),
    "a bad tool schema, tool_choice left out": (
        "/v1/chat/completions",
        _chat(tools=BAD_TOOL),
        400,
        "tools[0].function.parameters",
        "not a valid JSON schema",
    ),
    "tool_choice names an undeclared function": (
        "/v1/chat/completions",
        _chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
        "tool_choice",
        r"^Tool 'f' has not been passed in `tools`\.$",
    ),
    "tool_choice required without tools": (
        "/v1/chat/completions",
        _chat(tool_choice="required"),
        400,
        "tool_choice",
        "needs tools",
    ),
    "functions asked for": (
        "/v1/chat/completions",
        _chat(functions=[{"name": "f"}]),
        400,
        "functions",
        "declare them as tools",
    ),
    "audio output": (
        "/v1/chat/completions",
        _chat(modalities=["text", "audio"]),
        400,
        "modalities",
        "audio",
    ),
    "store true": ("/v1/chat/completions", _chat(store=True), 400, "store", "keeps no outputs"),
    "image content": (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content[0].type",
        "'image_url' are not supported",
    ),
    "continue_final_message with add_generation_prompt": (
        "/v1/chat/completions",
        _chat(
            messages=[*CHAT, {"role": "assistant", "content": "Hel"}],
            continue_final_message=True,
            add_generation_prompt=True,
        ),
        400,
        "continue_final_message",
        "cannot both be true",
    ),
    "continue_final_message after a user message": (
        "/v1/chat/completions",
        _chat(continue_final_message=True),
        400,
        "continue_final_message",
        "assistant",
    ),
    "logprobs above 20": ("/v1/completions", _completion(logprobs=21), 400, "logprobs", "20"),
    "top_logprobs without logprobs": (
        "/v1/chat/completions",
        _chat(top_logprobs=2),
        400,
        "top_logprobs",
        "logprobs: true",
    ),
    "top_logprobs above 20": (
        "/v1/chat/completions",
        _chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        "20",
    ),
    "missing prompt": ("/v1/completions", {"max_tokens": 2}, 400, "prompt", "required"),
    "prompt wrong type": (
        "/v1/completions",
        _completion(prompt=5),
        400,
        "prompt",
        "a string, a list of token ids",
    ),
    "empty prompt": (
        "/v1/completions",
        _completion(prompt=""),
        400,
        "prompt",
        "The prompt cannot be empty",
    ),
    "empty token prompt": ("/v1/completions", _completion(prompt=[]), 400, "prompt", "empty"),
    "empty prompt, streaming": (
        "/v1/completions",
        _completion(prompt="", stream=True),
        400,
        "prompt",
        "empty",
    ),
    "prompt list mixing strings and ids": (
        "/v1/completions",
        _completion(prompt=["a", 5]),
        400,
        "prompt",
        "a list of strings or of token-id lists",
    ),
    "one of several prompts empty": (
        "/v1/completions",
        _completion(prompt=["a", ""]),
        400,
        "prompt",
        "empty",
    ),
    "one of several prompts too long": (
        "/v1/completions",
        _completion(prompt=["a", [5] * 2048]),
        400,
        "prompt",
        r"you requested 2050 tokens \(2048 in the prompt, 2 in the completion\)",
    ),
    "token id outside the vocab": (
        "/v1/completions",
        _completion(prompt=[1, 10**9]),
        400,
        "prompt",
        "^Token id 1000000000 is out of vocabulary",
    ),
    "prompt longer than the context": (
        "/v1/completions",
        _completion(prompt=LONG_TEXT),
        400,
        "prompt",
        r"^This model's maximum context length is 2048 tokens\. However, you requested \d{4} "
        r"tokens \(\d{4} in the prompt, 2 in the completion\)\. Please reduce the length of the "
        r"prompt or completion\.$",
    ),
    "chat longer than the context": (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "messages",
        r"maximum context length is 2048 tokens\. However, you requested \d{4} tokens "
        r"\(\d{4} in the messages, 2 in the completion\)",
    ),
    "chat longer than the context, no max_tokens": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG_TEXT}]},
        400,
        "messages",
        r"^This model's maximum context length is 2048 tokens\. However, the prompt has \d{4} "
        r"tokens, which leaves no room for the completion\. Please reduce the length of the "
        r"messages\.$",
    ),
    "token prompt longer than the context": (
        "/generate",
        {"input_ids": [5] * 2048},
        400,
        "input_ids",
        "maximum context length is 2048 tokens. However, the prompt has 2048 tokens",
    ),
    "no messages": ("/v1/chat/completions", _chat(messages=[]), 400, "messages", "at least 1"),
    "messages not a list": ("/v1/chat/completions", _chat(messages="hi"), 400, "messages", "array"),
    "role not a string": (  # any string is a role: the chat template renders it or fails
        "/v1/chat/completions",
        _chat(messages=[{"role": 5, "content": "x"}]),
        400,
        "messages[0].role",
        "string",
    ),
    "user content null": (
        "/v1/chat/completions",
        _chat(
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]
        ),
        400,
        "messages[1].content",
        r"^Invalid value for 'content': expected a string, got null\.$",
    ),
    "user content missing": (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user"}]),
        400,
        "messages[0].content",
        "got null",
    ),
    "assistant content null without tool calls": (
        "/v1/chat/completions",
        _chat(messages=[*CHAT, {"role": "assistant", "content": None}, *CHAT]),
        400,
        "messages[1].content",
        "got null",
    ),
    "content wrong type": (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
        "string",
    ),
    "unknown model": (
        "/v1/completions",
        _completion(model="gpt-4"),
        404,
        "model",
        "`gpt-4` does not exist",
    ),
    "unknown model (chat)": (
        "/v1/chat/completions",
        _chat(model="gpt-4", stream=True),
        404,
        "model",
        "does not exist",
    ),
    "generate: neither text nor ids": (
        "/generate",
        {"sampling_params": {}},
        400,
        "text",
        "exactly one",
    ),
    "generate: both text and ids": (
        "/generate",
        {"text": "a", "input_ids": [1]},
        400,
        "text",
        "exactly one",
    ),
    "generate: bad sampling value": (
        "/generate",
        {"text": "a", "sampling_params": {"temperature": -1}},
        400,
        "sampling_params.temperature",
        "temperature",
    ),
    "generate: max_new_tokens zero": (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 0}},
        400,
        "sampling_params.max_new_tokens",
        ">= 1",
    ),
    "generate: unknown sampling key": (
        "/generate",
        {"text": "a", "sampling_params": {"beam_width": 2}},
        400,
        "sampling_params",
        "beam_width",
    ),
    "generate: empty text": ("/generate", {"text": ""}, 400, "text", "empty"),
    "generate: unknown field": (
        "/generate",
        {"text": "a", "beam_width": 2},
        400,
        "beam_width",
        "unsupported parameter",
    ),
    "tokenize: both prompt and messages": (
        "/tokenize",
        {"prompt": "a", "messages": CHAT},
        400,
        "prompt",
        "exactly one",
    ),
    "tokenize: unknown model": ("/tokenize", {"prompt": "a", "model": "x"}, 404, "model", "`x`"),
    "detokenize: id outside the vocabulary": (
        "/detokenize",
        {"tokens": [1, 49152]},
        400,
        "tokens",
        "49152 is outside the vocabulary",
    ),
    "detokenize: negative id": (
        "/detokenize",
        {"tokens": [-1]},
        400,
        "tokens[0]",
        "greater than or equal to 0",
    ),
    "unknown route": ("/v1/embeddings", {"input": "x"}, 404, None, "Not Found"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_an_openai_error_body(http, case):
    path, body, status, param, pattern = CASES[case]
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(response.json()) == {"error"}
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert re.search(pattern, error["message"]), error["message"]
    if status == 404 and param == "model":
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"]
)
def test_a_body_declared_as_other_than_json_is_415(http, content_type):
    body = b'{"prompt": "Hello", "max_tokens": 2}'  # JSON, but not declared so
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/generate"):
        response = http.post(path, content=body, headers={"content-type": content_type})
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert error["type"] == "invalid_request_error" and content_type in error["message"]
    form = http.post("/v1/completions", data={"prompt": "Hello", "max_tokens": "2"})
    assert form.status_code == 415


def test_json_without_content_type_or_with_a_charset_is_accepted(http):
    body = b'{"prompt": "Hello", "max_tokens": 2}'
    for headers in ({}, {"content-type": "application/json; charset=utf-8"}):
        response = http.post("/v1/completions", content=body, headers=headers)
        assert response.status_code == 200, response.text


def test_unknown_model_id_is_404(http):
    response = http.get("/v1/models/gpt-4")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["param"] == "model"


def test_wrong_method_is_405_with_the_body(http):
    response = http.get("/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4000)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", suffix="!")
    assert err.value.body["param"] == "suffix"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert err.value.code == "model_not_found"


def test_a_context_overflow_is_openais_error(client):
    """OpenAI's code and phrase, which clients match to tell an overflow from other bad input,
    for a prompt too long and for an output budget too large."""
    long_chat = [{"role": "user", "content": LONG_TEXT}]
    for kwargs, param in (
        ({"messages": long_chat}, "messages"),
        ({"messages": CHAT, "max_tokens": 4000}, "max_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, **kwargs)
        assert err.value.code == "context_length_exceeded"
        assert err.value.body["param"] == param
        assert "This model's maximum context length is 2048 tokens." in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=LONG_TEXT)
    assert err.value.code == "context_length_exceeded" and err.value.body["param"] == "prompt"


def test_server_still_serves_after_bad_input(http):
    assert http.get("/health").status_code == 200
    response = http.post(
        "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
