"""Conformance of sampling over the API, from the OpenAI API reference (and vLLM's extensions),
against a real server (the built-in SmolLM2 on CPU, conftest.py's `http_server`): `n` choices,
several prompts per completions request, `echo` (with the prompt's logprobs), `logprobs` /
`top_logprobs`, vLLM's `prompt_logprobs`, streams with one delta per choice, and usage
(`continuous_usage_stats`). Each feature's effect is checked, not only its acceptance."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from http_helpers import CHAT, MODEL, PROMPT, post_ok

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


def complete(http: httpx.Client, **fields) -> dict:
    return post_ok(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, **fields})


def chat(http: httpx.Client, **fields) -> dict:
    return post_ok(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, **fields})


def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def texts(response: dict) -> list[str]:
    return [c["text"] for c in response["choices"]]


GREEDY = {"temperature": 0, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "seed": 1234, "ignore_eos": True}


# ---- n --------------------------------------------------------------------------------------


def test_n3_greedy_choices_are_equal(http, client):
    one = complete(http, **GREEDY)
    three = complete(http, n=3, **GREEDY)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert texts(three) == texts(one) * 3
    assert [c["finish_reason"] for c in three["choices"]] == ["length"] * 3
    usage = three["usage"]  # the prompt counted once, every choice's output
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 3 * 5
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, n=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) == 1


def test_sampled_choices_differ_and_repeat_with_the_seed(http):
    first = complete(http, n=3, max_tokens=10, **SAMPLED)
    assert len(set(texts(first))) > 1
    assert texts(complete(http, n=3, max_tokens=10, **SAMPLED)) == texts(first)
    other = complete(http, n=3, max_tokens=10, **{**SAMPLED, "seed": 99})
    assert texts(other) != texts(first)
    replies = chat(http, n=3, max_tokens=10, **SAMPLED)["choices"]
    assert len({c["message"]["content"] for c in replies}) > 1


def test_best_of_equal_to_n_is_n(http):
    assert texts(complete(http, n=2, best_of=2, **SAMPLED)) == texts(complete(http, n=2, **SAMPLED))


# ---- several prompts ------------------------------------------------------------------------


def test_several_prompts_answer_in_order_each_as_alone(http):
    alone = [texts(complete(http, prompt=p, **GREEDY))[0] for p in PROMPTS]
    together = complete(http, prompt=PROMPTS, n=2, **GREEDY)
    assert [c["index"] for c in together["choices"]] == list(range(6))
    assert texts(together) == [t for t in alone for _ in range(2)]  # prompt_index * n + choice
    prompt_tokens = sum(complete(http, prompt=p)["usage"]["prompt_tokens"] for p in PROMPTS)
    assert together["usage"]["prompt_tokens"] == prompt_tokens
    assert together["usage"]["completion_tokens"] == 6 * 5


def test_several_token_id_prompts(http, client):
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS[:2]]
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in out.choices] == [
        texts(complete(http, prompt=p, **GREEDY))[0] for p in PROMPTS[:2]
    ]


def test_several_prompts_streamed(http):
    body = {"prompt": PROMPTS, "max_tokens": 4, **GREEDY}
    whole = complete(http, **body)
    streamed: dict[int, str] = defaultdict(str)
    finish = {}
    for event in events(http, "/v1/completions", body):
        (choice,) = event["choices"]
        streamed[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert [streamed[i] for i in range(3)] == texts(whole)
    assert finish == {0: "length", 1: "length", 2: "length"}


# ---- echo -----------------------------------------------------------------------------------


def test_echo_returns_the_prompt_then_the_completion(http, client):
    plain = texts(complete(http, **GREEDY))[0]
    assert texts(complete(http, echo=True, **GREEDY)) == [PROMPT + plain]
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert texts(complete(http, prompt=ids, echo=True, **GREEDY)) == [PROMPT + plain]
    sdk = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        echo=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in sdk if c.choices) == PROMPT + plain
    several = complete(http, prompt=PROMPTS[:2], echo=True, **GREEDY)
    assert [t.startswith(p) for t, p in zip(texts(several), PROMPTS, strict=False)] == [True] * 2


def test_echo_without_output_returns_the_prompt(http):
    out = complete(http, echo=True, max_tokens=0)
    assert texts(out) == [PROMPT]


def test_echo_logprobs_are_the_prompts_then_the_outputs(http):
    """lm-eval-harness' loglikelihood request: the prompt's tokens with their logprobs, the
    first one's null."""
    count = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    out = complete(http, echo=True, logprobs=2, **GREEDY)["choices"][0]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == count + 5
    assert "".join(lp["tokens"]) == out["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert token in top and 1 <= len(top) <= 3
    only = complete(http, echo=True, max_tokens=0, logprobs=1)["choices"][0]["logprobs"]
    assert only["tokens"] == lp["tokens"][:count]
    assert only["token_logprobs"] == pytest.approx(lp["token_logprobs"][:count], abs=1e-4)


def test_echo_logprobs_equal_the_engines_teacher_forced_ones(http):
    """The logprobs the engine gave its own greedy tokens are what the same tokens get when
    sent back as a prompt (teacher-forced), up to prefill/decode rounding."""
    generated = complete(http, logprobs=0, max_tokens=8, **GREEDY)["choices"][0]
    count = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    forced = complete(http, prompt=PROMPT + generated["text"], echo=True, max_tokens=0, logprobs=0)
    lp = forced["choices"][0]["logprobs"]
    assert lp["tokens"][count:] == generated["logprobs"]["tokens"]
    assert lp["token_logprobs"][count:] == pytest.approx(
        generated["logprobs"]["token_logprobs"], abs=2e-3
    )


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_zero_and_twenty(http):
    zero = complete(http, logprobs=0, **GREEDY)["choices"][0]["logprobs"]
    assert all(
        list(top) == [t] for t, top in zip(zero["tokens"], zero["top_logprobs"], strict=True)
    )
    twenty = complete(http, logprobs=20, **GREEDY)["choices"][0]["logprobs"]
    assert all(len(top) >= 19 for top in twenty["top_logprobs"])  # texts of ids may coincide
    chat0 = chat(http, logprobs=True, top_logprobs=0, **GREEDY)["choices"][0]["logprobs"]
    assert all(entry["top_logprobs"] == [] for entry in chat0["content"])
    chat20 = chat(http, logprobs=True, top_logprobs=20, **GREEDY)["choices"][0]["logprobs"]
    for entry in chat20["content"]:
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(values) == 20 and values == sorted(values, reverse=True)


def test_logprobs_per_choice(http):
    out = complete(http, n=2, logprobs=1, max_tokens=4, **SAMPLED)
    for choice in out["choices"]:
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]


def test_prompt_logprobs_field(http):
    count = http.post("/tokenize", json={"prompt": PROMPT}).json()
    out = complete(http, prompt_logprobs=2, **GREEDY)["choices"][0]["prompt_logprobs"]
    assert len(out) == count["count"] and out[0] is None
    for token_id, entry in zip(count["tokens"][1:], out[1:], strict=True):
        own = entry[str(token_id)]
        assert own["logprob"] <= 0 and own["decoded_token"]
        ranked = sorted(
            (e for e in entry.values() if e["rank"] is not None), key=lambda e: e["rank"]
        )
        assert [e["rank"] for e in ranked][:2] == [1, 2]
    reply = chat(http, prompt_logprobs=0, **GREEDY)
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]


# ---- streams and usage ----------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_of_two_choices_equals_the_whole_answer(http, route):
    body = {"n": 2, "max_tokens": 8, **SAMPLED}
    body |= {"prompt": PROMPT} if route == "/v1/completions" else {"messages": CHAT}
    whole = post_ok(http, route, body)["choices"]
    got: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    roles = []
    for event in events(http, route, body):
        (choice,) = event["choices"]
        if route == "/v1/completions":
            got[choice["index"]] += choice["text"]
        else:
            got[choice["index"]] += choice["delta"].get("content") or ""
            roles += [choice["index"]] if choice["delta"].get("role") else []
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    key = (
        (lambda c: c["text"]) if route == "/v1/completions" else (lambda c: c["message"]["content"])
    )
    assert [got[0], got[1]] == [key(c) for c in whole]
    assert finish == {0: "length", 1: "length"}
    if route != "/v1/completions":
        assert roles == [0, 1]  # one opening delta per choice


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(http, route):
    usage = {"include_usage": True, "continuous_usage_stats": True}
    body = {"max_tokens": 6, **GREEDY, "stream_options": usage}
    body |= {"prompt": PROMPT} if route == "/v1/completions" else {"messages": CHAT}
    chunks = events(http, route, body)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    # every chunk carries its choice's usage so far, growing to the final one
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[0] < counts[-1] == 6
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["usage"]["prompt_tokens"]}
    plain = events(http, route, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])
