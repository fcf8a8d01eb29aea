"""Conformance of the request fields, from the OpenAI API reference and vLLM's and SGLang's
documented extensions, against a real server (the built-in SmolLM2 on CPU, conftest.py's
`http_server`), with the official `openai` client and raw httpx: every field sent at its
default is accepted and changes nothing, unknown fields are ignored, the vendor fields act,
and the extra endpoints (`/v1/models/{id}`, `/tokenize`, `/detokenize`) answer as vLLM's do."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from http_helpers import CHAT, CONTEXT_LEN, MODEL, PROMPT, post_ok

# every /v1/completions field of the OpenAI reference, at its default value
COMPLETION_DEFAULTS = {
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0,
    "logit_bias": {},
    "logprobs": None,
    "n": 1,
    "presence_penalty": 0,
    "seed": None,
    "stop": None,
    "stream": False,
    "stream_options": None,
    "suffix": None,
    "top_p": 1,
    "user": "someone",
}
# every /v1/chat/completions field of the OpenAI reference, at its default value
CHAT_DEFAULTS = {
    "audio": None,
    "frequency_penalty": 0,
    "function_call": "none",
    "functions": [],
    "logit_bias": {},
    "logprobs": False,
    "metadata": {"team": "a"},
    "modalities": ["text"],
    "n": 1,
    "parallel_tool_calls": True,
    "prediction": None,
    "presence_penalty": 0,
    "prompt_cache_key": "k",
    "reasoning_effort": None,
    "response_format": {"type": "text"},
    "safety_identifier": "s",
    "seed": 5,
    "service_tier": "auto",
    "stop": [],
    "store": False,
    "stream": False,
    "stream_options": None,
    "tool_choice": "none",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1,
    "user": "someone",
    "verbosity": None,
    "web_search_options": None,
}
# the vendor fields of SGLang and vLLM, at their defaults
VENDOR_DEFAULTS = {
    "top_k": -1,
    "min_p": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "stop_token_ids": [],
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "regex": None,
    "ebnf": None,
    "json_schema": None,
    "structured_outputs": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_grammar": None,
    "guided_choice": None,
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": None,
    "prompt_logprobs": None,
}
CHAT_VENDOR_DEFAULTS = {
    **VENDOR_DEFAULTS,
    "continue_final_message": False,
    "add_generation_prompt": True,
    "add_special_tokens": False,
    "echo": False,
}


def complete(http: httpx.Client, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    return post_ok(http, "/v1/completions", body)


def chat(http: httpx.Client, **fields) -> dict:
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, **fields}
    return post_ok(http, "/v1/chat/completions", body)


def token_counts(response: dict) -> dict:
    """The usage but for its cached tokens, which grow as a prompt is sent again."""
    return {k: v for k, v in response["usage"].items() if k != "prompt_tokens_details"}


# ---- defaults and unknown fields -------------------------------------------------------------


def test_every_completions_field_at_its_default_changes_nothing(http, client):
    plain = complete(http)
    full = complete(http, **COMPLETION_DEFAULTS, **VENDOR_DEFAULTS)
    assert full["choices"][0]["text"] == plain["choices"][0]["text"]
    assert token_counts(full) == token_counts(plain)
    sdk = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        best_of=1,
        echo=False,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        n=1,
        suffix="",
        top_p=1,
        user="someone",
        extra_body=VENDOR_DEFAULTS,
    )
    assert sdk.choices[0].text == plain["choices"][0]["text"]


def test_every_chat_field_at_its_default_changes_nothing(http, client):
    plain = chat(http)
    full = chat(http, **CHAT_DEFAULTS, **CHAT_VENDOR_DEFAULTS)
    assert full["choices"][0]["message"] == plain["choices"][0]["message"]
    assert token_counts(full) == token_counts(plain)
    sdk = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=6,
        temperature=0,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        logprobs=False,
        n=1,
        parallel_tool_calls=True,
        response_format={"type": "text"},
        store=False,
        metadata={"team": "a"},
        modalities=["text"],
        service_tier="auto",
        tools=[],
        tool_choice="none",
        user="someone",
    )
    assert sdk.choices[0].message.content == plain["choices"][0]["message"]["content"]


def test_a_stream_with_every_field_at_its_default(http):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    body |= {**CHAT_DEFAULTS, **CHAT_VENDOR_DEFAULTS, "stream": True}
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": False}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines
    )
    assert text == chat(http)["choices"][0]["message"]["content"]


def test_unknown_fields_are_ignored_and_logged(http, http_server):
    plain = complete(http)
    weird = complete(http, frobnicate=1, response_format={"type": "text", "bogus": True})
    assert weird["choices"][0]["text"] == plain["choices"][0]["text"]
    message = {"role": "user", "content": "Name three colours.", "mood": "happy"}
    assert (
        chat(http, messages=[message], xyzzy=[1])["choices"][0]["message"]
        == (chat(http)["choices"][0]["message"])
    )
    log = http_server.stderr_tail()
    assert "ignored unknown field(s): frobnicate, response_format.bogus" in log
    assert "ignored unknown field(s): xyzzy, messages[0].mood" in log


def test_null_means_the_default(http):
    nulls = {name: None for name in ("n", "stream", "echo", "logprobs", "top_k", "min_tokens")}
    assert complete(http, **nulls)["choices"][0]["text"] == complete(http)["choices"][0]["text"]


# ---- vendor fields act ------------------------------------------------------------------------


def greedy_ids(http: httpx.Client, n: int = 6) -> list[int]:
    """The greedy output's token ids for PROMPT (from the native route)."""
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return http.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()[
        "output_ids"
    ]


def test_stop_token_ids_end_the_output_at_that_token(http):
    ids = greedy_ids(http)
    stopped = complete(http, ignore_eos=True, stop_token_ids=[ids[2]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == ids.index(ids[2]) + 1


def test_top_k_one_is_greedy_and_zero_is_off(http):
    greedy = complete(http)["choices"][0]["text"]
    assert complete(http, temperature=1.0, top_k=1, seed=3)["choices"][0]["text"] == greedy
    assert complete(http, top_k=0)["choices"][0]["text"] == greedy


def test_continue_final_message_and_echo(http):
    """The reply continues the assistant's unfinished message; with echo it starts with it."""
    messages = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    opts = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    tokens = http.post("/tokenize", json=opts).json()["tokens"]
    detok = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert detok.endswith("<|im_start|>assistant\nRed, green and")  # left open, no end marker
    plain = chat(http, **opts)
    assert plain["usage"]["prompt_tokens"] == len(tokens)
    echoed = chat(http, **opts, echo=True)
    content = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Red, green and" + content


def test_tool_calls_and_tool_results_in_messages_are_accepted(http):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "red, green, blue"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reply = chat(http, messages=messages, tools=tools, tool_choice="none")
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["prompt_tokens"] > chat(http)["usage"]["prompt_tokens"]


# ---- responses: usage, fingerprint, models ------------------------------------------------


def test_usage_details_and_system_fingerprint(http, client):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    for response in (completion, reply):
        assert (
            0 <= response.usage.prompt_tokens_details.cached_tokens < response.usage.prompt_tokens
        )
        assert re.fullmatch(r"fp_[0-9a-f]{12}", response.system_fingerprint)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1  # prefix cache
    assert completion.system_fingerprint == reply.system_fingerprint
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True))
    assert {c.system_fingerprint for c in chunks} == {completion.system_fingerprint}


def test_model_by_id(http, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "replaylm"
    assert http.get(f"/v1/models/{MODEL}").json() == http.get("/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.code == "model_not_found"


# ---- /tokenize and /detokenize -----------------------------------------------------------


def test_tokenize_equals_the_servers_own_encoding(http):
    out = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == CONTEXT_LEN
    assert out["count"] == complete(http)["usage"]["prompt_tokens"]
    # the token ids as a prompt answer exactly as the text does
    as_ids = complete(http, prompt=out["tokens"])
    assert as_ids["choices"][0]["text"] == complete(http)["choices"][0]["text"]
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": PROMPT}
    strs = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == out["count"] and strs["token_strs"][0] == "The"


def test_tokenize_messages_as_the_chat_route_renders_them(http):
    out = http.post("/tokenize", json={"messages": CHAT}).json()
    assert out["count"] == chat(http)["usage"]["prompt_tokens"]
    text = http.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n")
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == out["tokens"][: bare["count"]] and bare["count"] < out["count"]


# ---- effects that need the sampler's penalties, logit_bias and the grammar engine -------------


def test_logit_bias_forces_a_token(http):
    token = http.post("/tokenize", json={"prompt": " banana"}).json()["tokens"][0]
    out = complete(http, logit_bias={str(token): 100}, ignore_eos=True, logprobs=0)
    assert out["choices"][0]["text"] == " banana" * 6
    banned = complete(http, logit_bias={str(t): -100 for t in greedy_ids(http)})
    assert banned["choices"][0]["text"] != complete(http)["choices"][0]["text"]


def test_penalties_reduce_repetition(http):
    prompt = "Repeat after me: go go go go go go go go go go"
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "logprobs": 0}

    def repeats(**penalty) -> int:
        tokens = complete(http, **body, **penalty)["choices"][0]["logprobs"]["tokens"]
        return max(tokens.count(t) for t in set(tokens))

    plain = repeats()
    assert plain >= 8  # greedy keeps repeating
    assert repeats(frequency_penalty=2) < plain
    assert repeats(presence_penalty=2) < plain
    assert repeats(repetition_penalty=2) < plain


def test_min_tokens_holds_eos_back(http):
    ask = [{"role": "user", "content": "Reply with one word: what colour is the sky?"}]
    reply = chat(http, max_tokens=40, messages=ask)
    short = reply["usage"]["completion_tokens"]
    assert reply["choices"][0]["finish_reason"] == "stop" and short < 30
    longer = chat(http, max_tokens=40, min_tokens=short + 5, messages=ask)
    assert longer["usage"]["completion_tokens"] >= short + 5


def test_json_response_formats_give_valid_json(http):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    ask = [{"role": "user", "content": "Give a colour and a number as JSON."}]
    reply = chat(http, max_tokens=60, messages=ask, response_format=fmt)["choices"][0]
    assert reply["finish_reason"] == "stop"
    value = json.loads(reply["message"]["content"])
    assert set(value) == {"colour", "count"} and isinstance(value["count"], int)
    ask = [{"role": "user", "content": 'Answer with {"sky": "<colour>"}: what colour is the sky?'}]
    obj = chat(http, max_tokens=60, messages=ask, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)


def test_regex_and_choice_constraints(http):
    out = complete(http, regex=r"[0-9]{3}-[a-z]{2}", max_tokens=20)["choices"][0]["text"]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out), out
    pick = complete(http, guided_choice=["Paris", "Lyon"], max_tokens=10)["choices"][0]["text"]
    assert pick in ("Paris", "Lyon")
