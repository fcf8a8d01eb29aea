"""The prefix cache as clients see it (the built-in SmolLM2 server on the CPU): a second chat
with the same system prompt reports its cached tokens in `usage`, /metrics counts hits, and
POST /flush_cache empties what no request holds; with --disable-radix-cache nothing is cached."""

from __future__ import annotations

import re

import httpx
import pytest

from server_process import start_server

SYSTEM = (
    "You are a careful assistant for a small bakery. You answer questions about opening hours, "
    "bread, cakes and prices in one short sentence, politely, without inventing facts."
)


def _chat(base_url: str, question: str) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def _flush(base_url: str) -> int:
    r = httpx.post(f"{base_url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["freed_tokens"]


@pytest.mark.parametrize("cache", [True, False], ids=["cache_on", "cache_off"])
def test_cached_tokens_metrics_and_flush(cache):
    server = start_server(*([] if cache else ["--disable-radix-cache"]))
    try:
        url = server.base_url
        first = _chat(url, "When do you open on Sundays?")
        second = _chat(url, "Do you sell rye bread?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        hits = _metric(url, "replaylm_prefix_cache_hit_tokens")
        held = _metric(url, "replaylm_prefix_cache_tokens")
        if cache:
            # the system prompt (30+ tokens through the chat template) is shared
            assert 30 <= cached < second["usage"]["prompt_tokens"]
            assert hits == cached and held > 0
            assert _flush(url) == held
        else:
            assert cached == hits == held == 0
        assert _flush(url) == 0
    finally:
        server.stop()
