"""SGLang's and vLLM's request fields, response fields and routes against a real server (the
built-in SmolLM2 on CPU, conftest.py's `http_server`): `matched_stop`, the model card's `root` /
`parent`, assistant prefill, custom roles, `truncate_prompt_tokens`, `return_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `allowed_token_ids`, `bad_words`,
`POST /invocations`, `request_id`, `documents`, and the fields the engine cannot honour refused
by name."""

from __future__ import annotations

import json

import httpx
import pytest

from replaylm.entrypoints.openai_chat_protocol import ChatCompletionRequest, ChatMessage
from replaylm.entrypoints.serving_chat import template_errors
from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.tokenizer import chat_input_ids, load_tokenizer
from replaylm.runtime.errors import RequestError

from http_helpers import CHAT, CONTEXT_LEN, MODEL, PROMPT, post_ok

REPLY_IN_ONE_WORD = [{"role": "user", "content": "Reply with one word: what colour is the sky?"}]


def complete(http: httpx.Client, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}
    return post_ok(http, "/v1/completions", body)


def chat(http: httpx.Client, **fields) -> dict:
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, **fields}
    return post_ok(http, "/v1/chat/completions", body)


def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON events of a stream from `path`."""
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[6:]) for line in lines]


def tokens(http: httpx.Client, **body) -> list[int]:
    return http.post("/tokenize", json=body).json()["tokens"]


def detokenize(http: httpx.Client, ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def refused(http: httpx.Client, path: str, body: dict, param: str) -> str:
    """The message of a 400 naming `param`."""
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


# ---- SGLang: matched_stop, the model card ------------------------------------------------------


def test_matched_stop_names_what_ended_each_choice(http):
    greedy = complete(http, return_token_ids=True)["choices"][0]
    assert greedy["finish_reason"] == "length" and greedy["matched_stop"] is None
    stop = greedy["text"].split()[1]
    by_string = complete(http, stop=[stop])["choices"][0]
    assert (by_string["finish_reason"], by_string["matched_stop"]) == ("stop", stop)
    token = greedy["token_ids"][2]
    by_token = complete(http, stop_token_ids=[token])["choices"][0]
    assert (by_token["finish_reason"], by_token["matched_stop"]) == ("stop", token)
    # EOS: its id, as SGLang reports it
    reply = chat(http, messages=REPLY_IN_ONE_WORD, max_tokens=40, return_token_ids=True)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == choice["token_ids"][-1]
    assert detokenize(http, [choice["matched_stop"]]) == "<|im_end|>"


def test_matched_stop_in_streams(http):
    stop = complete(http)["choices"][0]["text"].split()[1]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": stop}
    last = events(http, "/v1/completions", body)[-1]["choices"][0]
    assert (last["finish_reason"], last["matched_stop"]) == ("stop", stop)
    body = {"messages": REPLY_IN_ONE_WORD, "max_tokens": 40, "temperature": 0}
    chunks = [c["choices"][0] for c in events(http, "/v1/chat/completions", body)]
    assert [c["matched_stop"] for c in chunks if c["finish_reason"]] == [2]  # <|im_end|>
    assert all(c["matched_stop"] is None for c in chunks if not c["finish_reason"])


def test_model_card_has_root_parent_and_max_model_len(http):
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["root"] and card["parent"] is None and card["max_model_len"] == CONTEXT_LEN
    assert http.get("/v1/models").json()["data"] == [card]


# ---- chat prompts: assistant prefill, custom roles ---------------------------------------------


def test_assistant_prefill_continues_the_last_message(http):
    """continue_final_message (add_generation_prompt then defaults to false): the prompt ends
    inside the assistant's message, with no new assistant turn after it."""
    messages = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    reply = chat(http, messages=messages, continue_final_message=True, return_token_ids=True)
    prompt = detokenize(http, reply["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\nRed, green and")
    assert prompt.count("<|im_start|>assistant") == 1
    explicit = chat(
        http, messages=messages, continue_final_message=True, add_generation_prompt=False
    )
    assert explicit["choices"][0]["message"] == reply["choices"][0]["message"]


def test_custom_roles_reach_the_chat_template(http):
    messages = [*CHAT, {"role": "tool_result", "content": "blue"}]
    reply = chat(http, messages=messages, return_token_ids=True)
    prompt = detokenize(http, reply["prompt_token_ids"])
    assert "<|im_start|>tool_result\nblue<|im_end|>" in prompt
    assert tokens(http, messages=messages) == reply["prompt_token_ids"]


def test_a_template_failing_on_a_custom_role_names_that_role():
    messages = [ChatMessage(role="user", content="a"), ChatMessage(role="critic", content="b")]
    with pytest.raises(RequestError) as err, template_errors(messages):
        raise RequestError("cannot apply the chat template: unknown role", "messages")
    assert err.value.param == "messages[1].role" and "'critic'" in str(err.value)
    # with OpenAI's roles alone the error stays the messages'
    with pytest.raises(RequestError) as err, template_errors(messages[:1]):
        raise RequestError("cannot apply the chat template: unknown role", "messages")
    assert err.value.param == "messages"


def test_documents_reach_the_chat_template():
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    tokenizer.chat_template = (
        "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    docs = [{"title": "sky", "text": "blue"}, {"title": "grass", "text": "green"}]
    body = ChatCompletionRequest(messages=CHAT, documents=docs, chat_template_kwargs={"x": 1})
    assert body.template_options()["template_kwargs"] == {"x": 1, "documents": docs}
    ids = chat_input_ids(tokenizer, CHAT, **body.template_options())
    assert tokenizer.decode(ids).startswith("[sky: blue][grass: green]")


def test_the_response_id_is_made_from_request_id_or_x_request_id(http):
    assert complete(http, request_id="abc")["id"] == "cmpl-abc"
    assert chat(http, request_id="abc")["id"] == "chatcmpl-abc"
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "request_id": "abc"}
    headed = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "from-header"})
    assert headed.json()["id"] == "chatcmpl-from-header"  # vLLM: the header wins
    assert {
        e["id"]
        for e in events(
            http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "request_id": "s"}
        )
    } == {"cmpl-s"}


# ---- vLLM: truncate_prompt_tokens, return_token_ids ---------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(http):
    full = tokens(http, prompt=PROMPT)
    cut = complete(http, truncate_prompt_tokens=3, return_token_ids=True, echo=True)
    choice = cut["choices"][0]
    assert cut["usage"]["prompt_tokens"] == 3 and choice["prompt_token_ids"] == full[-3:]
    as_ids = complete(http, prompt=full[-3:])["choices"][0]["text"]
    assert choice["text"] == detokenize(http, full[-3:]) + as_ids  # echo shows what was kept
    assert complete(http, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(full)
    reply = chat(http, truncate_prompt_tokens=4, return_token_ids=True)
    assert reply["prompt_token_ids"] == tokens(http, messages=CHAT)[-4:]
    body = {"prompt": PROMPT, "truncate_prompt_tokens": CONTEXT_LEN + 1}
    assert str(CONTEXT_LEN) in refused(http, "/v1/completions", body, "truncate_prompt_tokens")
    refused(
        http, "/v1/completions", {**body, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"
    )


def test_return_token_ids_of_completions(http):
    out = complete(http, return_token_ids=True, n=2, temperature=1, seed=5)
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == tokens(http, prompt=PROMPT)
        assert (
            len(choice["token_ids"]) == 6
            and detokenize(http, choice["token_ids"]) == (choice["text"])
        )
    plain = complete(http)["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    chunks = [c["choices"][0] for c in events(http, "/v1/completions", body)]
    assert chunks[0]["prompt_token_ids"] == tokens(http, prompt=PROMPT)
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    streamed = [t for c in chunks for t in c["token_ids"]]
    assert streamed == complete(http, return_token_ids=True)["choices"][0]["token_ids"]


def test_return_token_ids_of_chat(http):
    whole = chat(http, return_token_ids=True)
    assert whole["prompt_token_ids"] == tokens(http, messages=CHAT)
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"]
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    chunks = events(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"] or []] == ids


# ---- vLLM: output options -----------------------------------------------------------------------


def test_include_stop_str_in_output(http):
    text = complete(http)["choices"][0]["text"]
    stop = text.split()[1]
    cut = complete(http, stop=stop)["choices"][0]["text"]
    kept = complete(http, stop=stop, include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == cut + stop and text.startswith(kept)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": stop}
    streamed = events(http, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert "".join(c["choices"][0]["text"] for c in streamed) == kept
    reply = chat(http)["choices"][0]["message"]["content"]
    stop = reply.split()[1]
    kept = chat(http, stop=[stop], include_stop_str_in_output=True)["choices"][0]["message"]
    assert reply.startswith(kept["content"]) and kept["content"].endswith(stop)


def test_skip_special_tokens_decides_whether_special_tokens_show(http):
    start = tokens(http, prompt="<|im_start|>")
    assert len(start) == 1  # a special token
    forced = {"logit_bias": {str(start[0]): 100}, "max_tokens": 2}
    assert complete(http, **forced)["choices"][0]["text"] == ""
    shown = complete(http, **forced, skip_special_tokens=False)["choices"][0]["text"]
    assert shown == "<|im_start|><|im_start|>"


def test_fields_the_engine_cannot_honour_are_refused_by_name(http, http_server):
    completion = {"prompt": PROMPT, "max_tokens": 2}
    refused(http, "/v1/completions", {**completion, "use_beam_search": True}, "use_beam_search")
    refused(
        http, "/v1/chat/completions", {"messages": CHAT, "use_beam_search": True}, "use_beam_search"
    )
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    refused(
        http, "/v1/chat/completions", {"messages": CHAT, "chat_template": template}, "chat_template"
    )
    refused(http, "/tokenize", {"messages": CHAT, "chat_template": template}, "chat_template")
    # at their defaults they ask for nothing
    defaults = {"use_beam_search": False, "allowed_token_ids": [], "bad_words": []}
    assert complete(http, **defaults)["choices"][0]["text"] == complete(http)["choices"][0]["text"]
    assert "ignored unknown field(s): use_beam_search" not in http_server.stderr_tail()
    vllm_only = {
        "priority": 1,
        "logits_processors": ["my_module.MyProcessor"],
        "vllm_xargs": {"threshold": 0.5},
        "cache_salt": "tenant-a",
        "kv_transfer_params": {"do_remote_decode": True},
    }
    for field, value in vllm_only.items():
        refused(http, "/v1/completions", {**completion, field: value}, field)
        refused(http, "/v1/chat/completions", {"messages": CHAT, field: value}, field)
    assert "Priority scheduling is not enabled" in refused(
        http, "/v1/completions", {**completion, "priority": -3}, "priority"
    )
    nothing_asked = {"priority": 0, "logits_processors": [], "cache_salt": "", "length_penalty": 1}
    assert (
        complete(http, **nothing_asked)["choices"][0]["text"]
        == complete(http)["choices"][0]["text"]
    )
    native = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    below = http.post("/generate", json={**native, "return_logprob": True, "logprob_start_len": -2})
    assert below.status_code == 400
    assert below.json()["error"]["param"] == "logprob_start_len"
    assert http.post("/generate", json={**native, "logprob_start_len": -1}).status_code == 200


# ---- vLLM: allowed_token_ids, bad_words ---------------------------------------------------------


def test_allowed_token_ids_are_the_only_ids_sampled(http):
    allowed = [tokens(http, prompt=word)[0] for word in (" blue", " red", " green")]
    for temperature in (0, 1.0):
        fields = dict(temperature=temperature, return_token_ids=True, max_tokens=8)
        out = complete(http, **fields, allowed_token_ids=allowed)["choices"][0]
        assert out["token_ids"] and set(out["token_ids"]) <= set(allowed), temperature
        chat_out = chat(http, **fields, ignore_eos=True, allowed_token_ids=allowed)
        assert set(chat_out["choices"][0]["token_ids"]) <= set(allowed), temperature
    outside = {"prompt": PROMPT, "allowed_token_ids": [10**6]}
    refused(http, "/v1/completions", outside, "allowed_token_ids")


def test_bad_words_ban_their_token_with_and_without_a_space(http):
    plain = complete(http, return_token_ids=True)["choices"][0]
    first = plain["token_ids"][0]
    word = detokenize(http, [first])
    assert word.startswith(" ")  # " Paris": its spaceless form is banned too
    banned = {first, *tokens(http, prompt=word.lstrip())}
    assert len(banned) == 2
    out = complete(http, return_token_ids=True, bad_words=[word.strip()])["choices"][0]
    assert out["text"] != plain["text"] and not banned & set(out["token_ids"])
    asked = dict(messages=[{"role": "user", "content": "What is the capital of France?"}])
    unbanned = chat(http, **asked, max_tokens=16, return_token_ids=True)
    assert banned & set(unbanned["choices"][0]["token_ids"])
    # a bare string is one word
    reply = chat(http, **asked, max_tokens=16, return_token_ids=True, bad_words=word.strip())
    assert not banned & set(reply["choices"][0]["token_ids"])
    body = {"prompt": PROMPT, "bad_words": ["capital city"]}
    assert "single-token" in refused(http, "/v1/completions", body, "bad_words")
    refused(http, "/v1/chat/completions", {"messages": CHAT, "bad_words": [" "]}, "bad_words")


# ---- SageMaker: /invocations ---------------------------------------------------------------------


def test_invocations_dispatch_on_the_body(http):
    as_chat = post_ok(http, "/invocations", {"messages": CHAT, "max_tokens": 6, "temperature": 0})
    assert as_chat["object"] == "chat.completion"
    assert as_chat["choices"][0]["message"] == chat(http)["choices"][0]["message"]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    as_completion = post_ok(http, "/invocations", body)
    assert as_completion["object"] == "text_completion"
    assert as_completion["choices"][0]["text"] == complete(http)["choices"][0]["text"]
    streamed = events(http, "/invocations", body)
    assert "".join(c["choices"][0]["text"] for c in streamed) == as_completion["choices"][0]["text"]
    assert "messages" in refused(http, "/invocations", {"input": "hi"}, "messages")
    bad = http.post(
        "/invocations", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
