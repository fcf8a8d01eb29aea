"""GET /metrics of a real server (built-in SmolLM2 on CPU, see conftest.py): each per-request
series counts exactly the requests sent, the timing histograms split the latency consistently,
preemptions are counted (tiny checkpoint, tiny KV cache), the KV pool's size shows from
start-up, and the README's metrics table lists
exactly the series served."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.runtime.io_struct import GenerateRequest
from replaylm.runtime.tokenizer_manager import TokenizerManager
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

from http_helpers import PROMPT, TIMEOUT_S, samples, scrape
from server_process import start_server
from tiny_checkpoints import write_tiny_checkpoint

README = Path(__file__).resolve().parents[2] / "README.md"


def complete(http: httpx.Client, **body: object) -> dict:
    response = http.post(
        "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body}
    )
    response.raise_for_status()
    return response.json()


def test_request_series_count_a_length_a_stop_and_an_aborted_request(http):
    aborted = 'replaylm_requests_total{finish_reason="abort"}'
    before = scrape(http)

    length = complete(http, max_tokens=6)
    assert length["choices"][0]["finish_reason"] == "length"
    stop_at = length["choices"][0]["text"].split()[-1]  # greedy: the same text comes again
    stop = complete(http, max_tokens=6, stop=[stop_at])
    assert stop["choices"][0]["finish_reason"] == "stop"
    stream_body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**stream_body, "stream": True}) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
    # leaving the block closed the connection mid-stream: the server aborts the request
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and scrape(http).get(aborted, 0.0) == before.get(aborted, 0):
        time.sleep(0.05)
    after = scrape(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for reason in ("length", "stop", "abort"):
        assert delta(f'replaylm_requests_total{{finish_reason="{reason}"}}') == 1, reason
    prompt_tokens = length["usage"]["prompt_tokens"]
    assert stop["usage"]["prompt_tokens"] == prompt_tokens
    assert delta("replaylm_request_prompt_tokens_count") == 3
    assert delta("replaylm_request_prompt_tokens_sum") == 3 * prompt_tokens
    assert delta("replaylm_prompt_tokens_total") == 3 * prompt_tokens
    generated = delta("replaylm_generation_tokens_total")
    assert generated > 6 + stop["usage"]["completion_tokens"]  # the aborted one's tokens too
    assert delta("replaylm_request_generation_tokens_count") == 3
    assert delta("replaylm_request_generation_tokens_sum") == generated
    for histogram in (
        "time_to_first_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
    ):
        assert delta(f"replaylm_{histogram}_seconds_count") == 3, histogram
        assert delta(f"replaylm_{histogram}_seconds_sum") > 0, histogram

    # queue + prefill time = time to first token (the admission is stamped in the scheduler
    # process, on the wall clock); time to first token + decode time = e2e latency
    queue_and_prefill = delta("replaylm_request_queue_time_seconds_sum") + delta(
        "replaylm_request_prefill_time_seconds_sum"
    )
    ttft = delta("replaylm_time_to_first_token_seconds_sum")
    assert queue_and_prefill == pytest.approx(ttft, abs=0.01)
    e2e = delta("replaylm_e2e_request_latency_seconds_sum")
    assert ttft + delta("replaylm_request_decode_time_seconds_sum") == pytest.approx(e2e, abs=1e-6)


def _readme_table() -> dict[str, tuple[str, set[str]]]:
    """The README's metrics table: name -> (type, label names)."""
    section = README.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    return {
        name.strip().strip("`"): (kind.strip(), set(re.findall(r"`(\w+)`", labels)))
        for name, kind, labels, _meaning in rows
    }


def test_readme_documents_exactly_the_series_served(http):
    exposition = http.get("/metrics").text
    served = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE))
    table = _readme_table()
    assert {name: kind for name, (kind, _) in table.items()} == served
    for key in samples(exposition):  # the labels of every series that has samples
        name, _, labels = key.partition("{")
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in table else name
        assert set(re.findall(r"(\w+)=", labels)) - {"le"} == table[family][1], key


def test_preemptions_are_counted(tmp_path):
    """Two 70-token requests cannot share 90 KV slots: the scheduler retracts one."""
    write_tiny_checkpoint("qwen2", tmp_path)
    manager = TokenizerManager(
        resolve_engine_config(
            ServerArgs(
                model_path=str(tmp_path), device="cpu", max_total_tokens=90, max_running_requests=4
            )
        )
    )

    async def one(i: int) -> int:
        params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
        outs = [out async for out in manager.generate(GenerateRequest([5 + i] * 10, params))]
        return outs[-1].completion_tokens

    async def together() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(3)))

    try:
        assert asyncio.run(together()) == [60] * 3
        served = samples(manager.metrics.render()[0].decode())
    finally:
        manager.shutdown()
    assert served["replaylm_num_preemptions"] > 0
    assert served["replaylm_request_generation_tokens_sum"] == 180
    assert served["replaylm_request_decode_time_seconds_count"] == 3


def test_kv_total_tokens_is_served_before_the_first_request(tmp_path):
    """The scheduler's stats come with its steps; the pool's size must not wait for one."""
    write_tiny_checkpoint("qwen2", tmp_path)
    server = start_server("--model-path", str(tmp_path), "--max-total-tokens", "256")
    try:
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
            served = scrape(http)
    finally:
        server.stop()
    assert served["replaylm_generation_tokens_total"] == 0
    assert served["replaylm_kv_total_tokens"] == 256
