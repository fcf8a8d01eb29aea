"""Several HTTP front ends (`--api-server-count`): they share the port and the scheduler, each
serves requests (streams equal to their answers), /metrics and the stored responses are the
server's whatever process answers, and the processes start and end together: SIGTERM stops all
(exit 0), a front end or the scheduler killed ends the server non-zero, the main process killed
leaves no orphan."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from replaylm.model_loader.builtin_models import resolve_model_path

from http_helpers import TIMEOUT_S, metric
from server_process import ServerProcess, launch_server, start_server
from tiny_checkpoints import write_tiny_checkpoint

FRONT_ENDS = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    write_tiny_checkpoint("qwen2", folder)
    return folder


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory) -> ServerProcess:
    """A tiny model with the built-in model's vocabulary, served with its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny_smollm2_vocab")
    write_tiny_checkpoint("llama_smollm2_vocab", folder)
    return server_factory(
        "--model-path", str(folder),
        "--tokenizer-path", resolve_model_path("smollm2-135m-instruct"),
        "--max-total-tokens", "4096", "--api-server-count", str(FRONT_ENDS),
    )  # fmt: skip


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _spawned(pid: int) -> list[int]:
    """The server's multiprocessing children: the scheduler, then the other front ends."""
    return [c for c in _children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


def _body(i: int, stream: bool) -> dict:
    return {
        "prompt": [5 + i % 50, 6, 7],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream(client: httpx.AsyncClient, i: int) -> list[str]:
    """The text of each chunk of request `i`'s stream."""
    texts = []
    async with client.stream("POST", "/v1/completions", json=_body(i, True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                texts.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    return texts


def test_every_front_end_serves_and_streams_equal_answers(server):
    # fresh connections land on whichever process accepts first: all of them, over enough tries
    seen = set()
    for _ in range(60):
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
            seen.add(http.get("/get_server_info").json()["api_server"]["index"])
        if len(seen) == FRONT_ENDS:
            break
    assert seen == set(range(FRONT_ENDS))

    async def run() -> tuple[list[str], list[list[str]]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=_body(i, False)) for i in range(60))
            )
            streams = await asyncio.gather(*(_stream(client, i) for i in range(60)))
        return [a.json()["choices"][0]["text"] for a in answers], list(streams)

    answers, streams = asyncio.run(run())
    assert ["".join(texts) for texts in streams] == answers


def test_metrics_count_every_front_ends_requests(server):
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
        before = metric(http, 'replaylm_requests_total{finish_reason="length"}', default=0.0)
        tokens = metric(http, "replaylm_generation_tokens_total", default=0.0)
    for i in range(30):  # a connection each: spread over the front ends
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
            assert http.post("/v1/completions", json=_body(i, False)).status_code == 200
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
        assert metric(http, 'replaylm_requests_total{finish_reason="length"}') == before + 30
        assert metric(http, "replaylm_generation_tokens_total") == tokens + 30 * 8
        assert metric(http, "replaylm_time_to_first_token_seconds_count") >= 30
        assert metric(http, "replaylm_kv_total_tokens") == 4096
        assert metric(http, "replaylm_num_running_requests") == 0


def test_a_stored_response_is_found_by_every_front_end(server):
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
        created = http.post(
            "/v1/responses", json={"input": "Hello", "max_output_tokens": 4, "temperature": 0}
        )
        assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    answered_by = set()
    for _ in range(30):
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
            got = http.get(f"/v1/responses/{response_id}")
            assert got.status_code == 200, got.text
            assert got.json()["id"] == response_id
            answered_by.add(http.get("/get_server_info").json()["api_server"]["index"])
    assert len(answered_by) > 1
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
        follow_up = http.post(
            "/v1/responses",
            json={"input": "Again", "previous_response_id": response_id, "max_output_tokens": 2},
        )
        assert follow_up.status_code == 200, follow_up.text
        assert http.delete(f"/v1/responses/{response_id}").status_code == 200
        assert http.get(f"/v1/responses/{response_id}").status_code == 404


def test_sigterm_stops_every_process(tiny_model):
    server = start_server("--model-path", str(tiny_model), "--api-server-count", "2")
    try:
        spawned = _spawned(server.proc.pid)
        assert len(spawned) == 2  # the scheduler and the second front end
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.stderr_tail()
        _wait_gone(spawned)
    finally:
        server.stop()


def test_sigterm_during_start_up_stops_every_process(tiny_model):
    """Before the main process serves (another front end may already answer /health),
    SIGTERM still ends the server with code 0 and no process left."""
    server = launch_server("--model-path", str(tiny_model), "--api-server-count", "2")
    try:
        deadline = time.monotonic() + 60
        while len(spawned := _spawned(server.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(spawned) == 2, server.stderr_tail()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.stderr_tail()
        _wait_gone(spawned)
    finally:
        server.stop()


@pytest.mark.parametrize("victim", ["front end", "scheduler"])
def test_a_killed_process_ends_the_server_non_zero(tiny_model, victim):
    server = start_server("--model-path", str(tiny_model), "--api-server-count", "2")
    try:
        scheduler, front_end = _spawned(server.proc.pid)
        os.kill(front_end if victim == "front end" else scheduler, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        log = server.stderr_tail(chars=100_000)
        reason = (
            "HTTP front-end process 1 exited (code -9)"
            if victim == "front end"
            else "the scheduler process exited"
        )
        assert f"stopping the server (exit code 1): {reason}" in log, log
        _wait_gone([scheduler, front_end])
    finally:
        server.stop()


def test_the_main_process_killed_leaves_no_orphan(tiny_model):
    server = start_server("--model-path", str(tiny_model), "--api-server-count", "2")
    try:
        spawned = _spawned(server.proc.pid)
        server.proc.kill()
        server.proc.wait(10)
        _wait_gone(spawned)  # the scheduler sees its first pipe close, the front end then its own
    finally:
        server.stop()


def test_a_port_in_use_is_one_line_and_exit_2(tiny_model):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable, "-m", "replaylm.launch_server", "--device", "cpu",
                "--model-path", str(tiny_model), "--port", str(port), "--api-server-count", "2",
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), result.stderr
