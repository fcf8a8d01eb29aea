"""The HTTP API of a real server (built-in SmolLM2 on CPU, see conftest.py), exercised with the
official `openai` client and with httpx. Greedy decoding throughout, so outputs are comparable."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from http_helpers import (
    CHAT,
    CONTEXT_LEN,
    KV_TOKENS,
    MODEL,
    PROMPT,
    TIMEOUT_S,
    TINY_API_KEY,
    metric,
    run_bench_serving,
)

# ---- completions and chat ---------------------------------------------------------------------


def test_completion_stream_equals_non_stream_with_usage(client):
    kwargs = dict(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text.strip()
    usage = full.usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 12

    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == choice.text
    assert sum(1 for t in texts if t) > 1  # really streamed, not one blob
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(usage)
    # the same prompt again: all of it but its last token comes from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream_with_usage(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content.strip()
    assert full.choices[0].finish_reason in ("stop", "length")
    # the chat template wraps the 4-word message in role markers
    assert full.usage.prompt_tokens > 8
    assert full.usage.completion_tokens <= 10

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert _counts(chunks[-1].usage) == _counts(full.usage)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


def _counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_completion_defaults_to_16_tokens_and_model_may_be_omitted(http):
    body = http.post(
        "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    ).json()
    assert body["model"] == MODEL and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 16


def test_chat_without_max_tokens_runs_until_eos(client):
    reply = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        messages=[{"role": "user", "content": "Reply with one word: what colour is the sky?"}],
    )
    assert reply.choices[0].finish_reason == "stop"  # EOS, not a length cut at 16 tokens
    assert reply.usage.completion_tokens >= 1


def test_token_id_prompt_matches_native_generate(client, http):
    ids = list(range(300, 307))
    completion = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.prompt_tokens == 7
    native = http.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    assert native["text"] == completion.choices[0].text
    assert len(native["output_ids"]) == 6
    assert native["meta_info"]["prompt_tokens"] == 7
    assert native["meta_info"]["completion_tokens"] == 6
    assert native["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_string_is_not_emitted(client):
    base = (
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = base[4:7]  # some text from the middle of the greedy output
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(out) if stream else [out]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == base[: base.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


# ---- logprobs -----------------------------------------------------------------------------------


def test_completion_logprobs(client):
    kwargs = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = client.completions.create(**kwargs).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and logprob <= 0
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely

    streamed = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)]
    assert [t for s in streamed if s for t in s.tokens] == lp.tokens
    # the streamed request's prompt comes from the prefix cache: its first token is sampled from
    # a one-token extend over the cached KV, not the whole prefill (float32 rounding apart)
    streamed_lps = [x for s in streamed if s for x in s.token_logprobs]
    assert streamed_lps == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client):
    full = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


# ---- concurrency ----------------------------------------------------------------------------


def _native_body(i: int) -> dict:
    """Request i: prompts of ~6 to ~70 tokens, 2 to 6 new tokens, half of them streamed."""
    words = " ".join(f"item {j}," for j in range(i + 1))
    return {
        "text": f"List: {words}",
        "stream": i % 2 == 1,
        "sampling_params": {"max_new_tokens": 2 + i % 5, "temperature": 0, "ignore_eos": True},
    }


async def _native_ids(client: httpx.AsyncClient, body: dict) -> list[int]:
    if not body["stream"]:
        return (await client.post("/generate", json=body)).json()["output_ids"]
    ids = []
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[len("data: ") :])["output_ids"]
    return ids


def test_16_concurrent_requests_equal_each_alone(http_server):
    bodies = [_native_body(i) for i in range(16)]

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(base_url=http_server.base_url, timeout=TIMEOUT_S) as c:
            alone = [await _native_ids(c, body) for body in bodies]
            together = await asyncio.gather(*(_native_ids(c, body) for body in bodies))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert [len(ids) for ids in alone] == [2 + i % 5 for i in range(16)]
    assert together == alone


# ---- abort, metrics, info ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_aborts_and_frees_kv(http, http_server, stream):
    aborted = 'replaylm_requests_total{finish_reason="abort"}'
    aborted_before = metric(http, aborted, default=0.0)
    body = {
        "prompt": PROMPT,
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(events)
            assert metric(http, "replaylm_kv_used_tokens") > 0
            assert metric(http, "replaylm_num_running_requests") == 1
        # leaving the block closed the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(
                f"{http_server.base_url}/v1/completions",
                json=body,
                timeout=httpx.Timeout(TIMEOUT_S, read=2.0),
            )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        metric(http, aborted, default=0.0) == aborted_before
        or metric(http, "replaylm_kv_used_tokens") > 0
    ):
        time.sleep(0.05)
    assert metric(http, "replaylm_kv_used_tokens") == 0
    assert metric(http, "replaylm_num_running_requests") == 0
    assert metric(http, aborted) == aborted_before + 1
    after = http.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


def test_metrics_series_count_requests_and_tokens(http):
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    for series in (
        "replaylm_requests_total",
        "replaylm_prompt_tokens_total",
        "replaylm_generation_tokens_total",
        "replaylm_num_running_requests",
        "replaylm_num_waiting_requests",
        "replaylm_kv_used_tokens",
        "replaylm_kv_usage_ratio",
        "replaylm_time_to_first_token_seconds_bucket",
        "replaylm_inter_token_latency_seconds_bucket",
    ):
        assert f"\n{series}" in response.text, series
    tokens = metric(http, "replaylm_generation_tokens_total")
    ttft = metric(http, "replaylm_time_to_first_token_seconds_count")
    finished = metric(http, 'replaylm_requests_total{finish_reason="length"}')
    http.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    ).raise_for_status()
    assert metric(http, "replaylm_generation_tokens_total") == tokens + 5
    assert metric(http, "replaylm_time_to_first_token_seconds_count") == ttft + 1
    assert metric(http, 'replaylm_requests_total{finish_reason="length"}') == finished + 1
    assert metric(http, "replaylm_kv_total_tokens") == KV_TOKENS


def test_models_server_info_and_health(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == CONTEXT_LEN
    info = http.get("/get_server_info").json()
    assert info["served_model_name"] == MODEL and info["device"] == "cpu"
    assert info["context_len"] == CONTEXT_LEN and info["max_total_tokens"] == KV_TOKENS
    assert info["api_key"] is None and info["healthy"] is True
    assert info["chunked_prefill_size"] == 2048  # a dense model's, resolved by the scheduler
    assert info["cuda_graph"]["decode"]["mode"] == "disabled"  # CPU: nothing captured
    assert info["cuda_graph_capture"] == {}
    assert http.get("/health").status_code == 200
    tokens = metric(http, "replaylm_generation_tokens_total")
    assert http.get("/health_generate").status_code == 200
    assert metric(http, "replaylm_generation_tokens_total") == tokens + 1  # it ran one token


def test_bench_serving_runs_against_the_server(http_server, tmp_path):
    doc = run_bench_serving(
        http_server.base_url,
        tmp_path / "bench.json",
        "--num-prompts",
        "3",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
        "--random-range-ratio",
        "1",
        "--warmup",
        "0",
        "--max-concurrency",
        "1",
        "3",
        "--json-requests",
    )
    assert [row["max_concurrency"] for row in doc["summary"]] == [1, 3]
    for row in doc["summary"]:
        assert row["completed"] == 3 and row["failed"] == 0 and row["model"] == MODEL
        assert row["tp_size"] == 1  # read from /get_server_info
        assert row["total_input_tokens"] == 24 and row["total_output_tokens"] == 9
        assert row["p50_ttft_ms"] > 0 and row["p99_itl_ms"] >= row["p50_itl_ms"] > 0
        assert row["output_token_throughput"] > 0
    # one in flight: the requests' lifetimes do not overlap, so they sum to at most the run's time
    # (the summary rounds it to 3 decimals: up to 0.5 ms below the measured one)
    one_at_a_time = [r["latency"] for r in doc["requests"] if r["max_concurrency"] == 1]
    assert len(one_at_a_time) == 3
    assert sum(one_at_a_time) <= doc["summary"][0]["duration_s"] + 5e-4


def test_bench_serving_prefix_workloads(http_server, tmp_path):
    """shared_prefix reads the cached tokens from the OpenAI usage; multi_turn's prompts grow by
    each answer (its ids streamed by /generate) and a new user message, turn by turn."""
    sizes = ["--random-output-len", "3", "--prefix-len", "12", "--suffix-len", "3"]
    sizes += ["--turns", "3", "--user-len", "4", "--num-prompts", "2"]
    shared_doc = run_bench_serving(
        http_server.base_url, tmp_path / "shared.json", *sizes, "--workload", "shared_prefix"
    )
    assert "requests" not in shared_doc  # per-request records only with --json-requests
    shared = shared_doc["summary"][0]
    assert shared["workload"] == "shared_prefix" and shared["completed"] == 2
    assert shared["total_input_tokens"] == 2 * (12 + 3) and shared["total_output_tokens"] == 6
    assert 0 <= shared["total_cached_tokens"] <= shared["total_input_tokens"]
    assert shared["cache_hit_rate"] == round(shared["total_cached_tokens"] / 30, 3)
    doc = run_bench_serving(
        http_server.base_url,
        tmp_path / "turns.json",
        *sizes,
        "--workload",
        "multi_turn",
        "--endpoint",
        "generate",
        "--json-requests",
    )
    (row,) = doc["summary"]
    assert row["completed"] == row["num_prompts"] == 2 * 3 and row["failed"] == 0
    turn_lens = [4, 4 + 3 + 4, 4 + 3 + 4 + 3 + 4]  # the server's count of each turn's prompt
    assert [r["input_len"] for r in doc["requests"]] == [n for n in turn_lens for _ in range(2)]
    assert row["total_output_tokens"] == 6 * 3


# ---- API key (conftest.py's tiny keyed server: starts in seconds) ---------------------------


PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", "/get_server_info"),
    ("GET", "/health_generate"),
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


def test_api_key_is_required_except_for_health_and_metrics(tiny_keyed_server):
    keyed = {"Authorization": f"Bearer {TINY_API_KEY}"}
    with httpx.Client(base_url=tiny_keyed_server.base_url, timeout=TIMEOUT_S) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TINY_API_KEY}):
            for method, path in PROTECTED:
                response = http.request(method, path, json=GENERATE, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key"
                assert error["type"] == "invalid_request_error" and error["message"]
        ok = http.post("/generate", json=GENERATE, headers=keyed)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        info = http.get("/get_server_info", headers=keyed).json()
        assert info["api_key"] == "<set>"  # never echoed back

    base_url = f"{tiny_keyed_server.base_url}/v1"
    good = openai.OpenAI(base_url=base_url, api_key=TINY_API_KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    completion = good.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=2, temperature=0
    )
    assert completion.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_the_readme_first_example_answers_well(http):
    """The README's first curl request, sent as written: greedy and short, so a newcomer's
    first answer is right and quick even on the CPU."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = readme[readme.index("curl http://127.0.0.1:30000/v1/chat/completions") :]
    body = json.loads(command[command.index("-d '") + 4 : command.index("}'") + 1])
    assert body["temperature"] == 0 and body["max_tokens"] <= 64
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
