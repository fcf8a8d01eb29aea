"""vLLM's `return_tokens_as_token_ids` (logprobs' tokens as `token_id:{id}`, on completions and
chat, whole and streamed) and `seed` over OpenAI's and vLLM's int64 range (a negative one taken
modulo 2**63), against conftest.py's `http_server`."""

from __future__ import annotations

import re

import httpx
import pytest
from test_vendor_compat import events, refused

from http_helpers import CHAT, PROMPT, post_ok

AS_IDS = {"return_tokens_as_token_ids": True}
LABEL = re.compile(r"token_id:\d+")


def labels(ids: list[int]) -> list[str]:
    return [f"token_id:{i}" for i in ids]


def complete(http: httpx.Client, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **fields}
    return post_ok(http, "/v1/completions", {"logprobs": 2, "return_token_ids": True, **body})


def chat(http: httpx.Client, **fields) -> dict:
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True, **fields}
    return post_ok(
        http, "/v1/chat/completions", {"top_logprobs": 2, "return_token_ids": True, **body}
    )


def test_completion_logprobs_as_token_ids(http):
    plain = complete(http)["choices"][0]
    as_ids = complete(http, **AS_IDS)["choices"][0]
    assert as_ids["text"] == plain["text"] and as_ids["token_ids"] == plain["token_ids"]
    lps, plain_lps = as_ids["logprobs"], plain["logprobs"]
    assert lps["tokens"] == labels(as_ids["token_ids"])
    assert "".join(plain_lps["tokens"]) == plain["text"]  # without the flag: the text, unchanged
    # the same logprobs (to float noise: the second request's prompt comes from the cache)
    assert lps["token_logprobs"] == pytest.approx(plain_lps["token_logprobs"], abs=1e-3)
    assert lps["text_offset"] == plain_lps["text_offset"]  # offsets still index the text
    tops = zip(lps["tokens"], lps["top_logprobs"], plain_lps["top_logprobs"], strict=True)
    for token, top, plain_top in tops:
        assert token in top and all(LABEL.fullmatch(key) for key in top)
        assert sorted(top.values()) == pytest.approx(sorted(plain_top.values()), abs=1e-3)


def test_echoed_prompt_tokens_as_token_ids(http):
    choice = complete(http, echo=True, max_tokens=2, **AS_IDS)["choices"][0]
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert choice["logprobs"]["tokens"] == labels(prompt_ids + choice["token_ids"])


def test_streamed_completion_as_token_ids(http):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    chunks = events(
        http, "/v1/completions", {**body, "logprobs": 1, "return_token_ids": True, **AS_IDS}
    )
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    ids = [t for c in choices for t in c["token_ids"] or []]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert len(ids) == 4 and tokens == labels(ids)


def test_chat_logprobs_as_token_ids(http):
    plain = chat(http)["choices"][0]
    as_ids = chat(http, **AS_IDS)["choices"][0]
    assert as_ids["token_ids"] == plain["token_ids"]
    content = as_ids["logprobs"]["content"]
    assert [e["token"] for e in content] == labels(as_ids["token_ids"])
    plain_content = plain["logprobs"]["content"]
    assert "".join(e["token"] for e in plain_content) == plain["message"]["content"]
    for entry, plain_entry in zip(content, plain_content, strict=True):
        assert entry["logprob"] == pytest.approx(plain_entry["logprob"], abs=1e-3)
        for e in [entry, *entry["top_logprobs"]]:
            assert LABEL.fullmatch(e["token"]) and e["bytes"] == list(e["token"].encode())
        top = [e["logprob"] for e in entry["top_logprobs"]]
        assert top == pytest.approx([e["logprob"] for e in plain_entry["top_logprobs"]], abs=1e-3)


def test_streamed_chat_as_token_ids(http):
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True}
    chunks = events(http, "/v1/chat/completions", {**body, "return_token_ids": True, **AS_IDS})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    tokens = [e["token"] for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert ids and tokens == labels(ids)


def sampled(http: httpx.Client, seed: int) -> list[int]:
    """The token ids a hot, seeded draw gives."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 2.0, "ignore_eos": True}
    body |= {"seed": seed, "return_token_ids": True}
    return post_ok(http, "/v1/completions", body)["choices"][0]["token_ids"]


def test_negative_seed_reproduces_as_its_value_modulo_2_63(http):
    minus_five = sampled(http, -5)
    assert sampled(http, -5) == minus_five
    # -5 is 2**63 - 5 to the engine: the same draw as that seed, another than seed 5's
    assert sampled(http, 2**63 - 5) == minus_five
    assert sampled(http, 5) != minus_five


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        (2**63, "less than or equal to 9223372036854775807"),
        (-(2**63) - 1, "greater than or equal to -9223372036854775808"),
    ],
)
def test_seed_outside_int64_is_refused(http, seed, message):
    body = {"prompt": PROMPT, "max_tokens": 1, "seed": seed}
    assert message in refused(http, "/v1/completions", body, "seed")


def test_int64_bounds_are_seeds(http):
    for seed in (-(2**63), 2**63 - 1):
        post_ok(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "seed": seed})
    post_ok(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "seed": -(2**63)})
