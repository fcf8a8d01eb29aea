"""The HTTP server under load: 500 concurrent streams on a tiny model with the built-in model's
tokenizer (so the front end, not the model, is what is busy). Requests that wait together enter
prefill batches together; every stream's text equals its non-stream answer (no token lost,
repeated or reordered, however many scheduler steps a chunk carries), a quarter of the streams
hang up early and free what they held, and the server is idle afterwards."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from replaylm.model_loader.builtin_models import resolve_model_path

from http_helpers import TIMEOUT_S, metric
from tiny_checkpoints import write_tiny_checkpoint

REQUESTS = 500
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_smollm2_vocab")
    write_tiny_checkpoint("llama_smollm2_vocab", folder)
    return server_factory(
        "--model-path",
        str(folder),
        "--tokenizer-path",
        resolve_model_path("smollm2-135m-instruct"),
        "--max-running-requests",
        "512",
        "--max-total-tokens",
        "40000",
        "--log-level",
        "info",
    )


def _body(i: int, stream: bool) -> dict:
    return {
        "prompt": f"Request {i}: count the apples in basket {i * 7 % 31}.",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream(client: httpx.AsyncClient, i: int, hang_up: bool) -> str:
    text = ""
    async with client.stream("POST", "/v1/completions", json=_body(i, True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            text += json.loads(line[len("data: ") :])["choices"][0]["text"]
            if hang_up and text:
                break  # leaving the block closes the connection mid-stream
    return text


def test_500_concurrent_streams_equal_their_answers_and_hang_ups_free_everything(server):
    async def run() -> tuple[list[str], list[str]]:
        limits = httpx.Limits(max_connections=REQUESTS + 10)
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=TIMEOUT_S, limits=limits
        ) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=_body(i, False)) for i in range(REQUESTS))
            )
            streamed = await asyncio.gather(
                *(_stream(client, i, hang_up=i % 4 == 0) for i in range(REQUESTS))
            )
        return [a.json()["choices"][0]["text"] for a in answers], list(streamed)

    answers, streamed = asyncio.run(run())
    for i, (answer, text) in enumerate(zip(answers, streamed, strict=True)):
        if i % 4 == 0:
            assert text and answer.startswith(text), i
        else:
            assert text == answer, i
    assert len(set(answers)) > REQUESTS // 2  # distinct prompts, distinct answers
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
        for _ in range(100):
            if metric(http, "replaylm_num_running_requests") == 0:
                break
            asyncio.run(asyncio.sleep(0.1))
        assert metric(http, "replaylm_num_running_requests") == 0
        assert metric(http, "replaylm_kv_used_tokens") == 0
        aborted = metric(http, 'replaylm_requests_total{finish_reason="abort"}', default=0.0)
        assert 0 < aborted <= REQUESTS // 4
    sizes = [
        int(n) for n in re.findall(r"prefill batch: (\d+) requests", server.stderr_tail(10**8))
    ]
    assert max(sizes) >= 16, sizes  # requests that wait together are admitted together


def _chat_body(i: int, stream: bool) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Basket {i}: how many apples?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def _chat_stream(client: httpx.AsyncClient, i: int, hang_up: bool) -> tuple[str, list]:
    text, kinds = "", []
    async with client.stream("POST", "/v1/chat/completions", json=_chat_body(i, True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            delta = choice["delta"]
            finish = choice.get("finish_reason")
            kinds.append("role" if delta.get("role") else "finish" if finish else "text")
            text += delta.get("content") or ""
            if hang_up and text:
                break
    return text, kinds


def test_concurrent_chat_streams_equal_their_answers_in_order(server):
    """Chat streams (their text-only chunks rendered and written as frames) give their
    non-streamed answers: the role's chunk first, the text, the finish last; hang-ups abort."""
    count = 100

    async def run() -> tuple[list[str], list[tuple[str, list]]]:
        limits = httpx.Limits(max_connections=count + 10)
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=TIMEOUT_S, limits=limits
        ) as client:
            answers = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=_chat_body(i, False))
                    for i in range(count)
                )
            )
            streamed = await asyncio.gather(
                *(_chat_stream(client, i, hang_up=i % 4 == 0) for i in range(count))
            )
        return [a.json()["choices"][0]["message"]["content"] for a in answers], list(streamed)

    answers, streamed = asyncio.run(run())
    for i, (answer, (text, kinds)) in enumerate(zip(answers, streamed, strict=True)):
        assert kinds[0] == "role", i
        if i % 4 == 0:
            assert text and answer.startswith(text), i
            continue
        assert text == answer, i
        assert kinds[-1] == "finish" and set(kinds[1:-1]) <= {"text"}, i
