"""A second start of the built-in SmolLM2 server on CUDA, on the caches the first one filled (the
tokenizer cache, Triton's kernel cache), is faster than the first, which starts with both empty,
and serves the same greedy answer; each start reports its stages, captures included."""

from __future__ import annotations

import time

import httpx
import pytest

from server_process import start_server

pytestmark = pytest.mark.gpu

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _start_and_ask() -> tuple[float, str, dict]:
    """(seconds from spawning the default server to /health, its greedy answer to PROMPT, its
    start-up stages from /get_server_info)."""
    spawned = time.perf_counter()
    server = start_server(device="cuda")
    try:
        healthy_s = time.perf_counter() - spawned
        answer = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"messages": PROMPT, "max_tokens": 24, "temperature": 0},
            timeout=120,
        ).json()["choices"][0]["message"]["content"]
        startup = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["startup"]
    finally:
        server.stop()
    return healthy_s, answer, startup


def test_a_warm_start_is_faster_and_answers_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAYLM_CACHE_DIR", str(tmp_path / "replaylm"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    cold_s, cold_answer, cold_stages = _start_and_ask()
    warm_s, warm_answer, warm_stages = _start_and_ask()
    print(f"cold start {cold_s:.1f} s, warm start {warm_s:.1f} s")
    assert warm_s < cold_s
    assert warm_answer == cold_answer and "Paris" in warm_answer
    for stages in (cold_stages, warm_stages):
        names = [s["name"] for s in stages["scheduler"]["stages"]]
        assert "capture decode" in names and "capture prefill" in names
        assert all(s["seconds"] >= 0 for p in stages.values() for s in p["stages"])
