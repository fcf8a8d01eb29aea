"""What a real server does when things go wrong: secrets stay out of its log, large bodies neither
stall it nor get past the size limit, a dead scheduler makes it exit non-zero, and a model that
cannot load is one line and exit code 2."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess, free_port
from tiny_checkpoints import write_tiny_checkpoint

BIG_TEXT = "hello world, this is a test. " * (5_000_000 // 29)  # ~5 MB, ~1.4M tokens
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    write_tiny_checkpoint("qwen2", folder)
    return folder


def _launch(*args: str) -> subprocess.CompletedProcess:
    """`launch_server` with `args` on the CPU and a free port (not the default one another
    test's server may hold), expected to exit by itself."""
    port = ["--port", str(free_port())]
    cmd = [sys.executable, "-m", "replaylm.launch_server", "--device", "cpu", *port, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _scheduler_pid(server: ServerProcess) -> int:
    """The server's scheduler child: the multiprocessing `spawn` child in /proc."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    spawned = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(spawned) == 1, children
    return int(spawned[0])


# ---- the API key ----------------------------------------------------------------------------


def test_api_key_is_never_logged_nor_shown(server_factory, tiny_model):
    key = f"key-{secrets.token_hex(8)}"
    server = server_factory(
        "--model-path", str(tiny_model), "--max-total-tokens", "256", "--api-key", key,
        "--log-level", "debug",
    )  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        ok = http.post("/generate", json=GENERATE, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
        wrong = http.post("/generate", json=GENERATE, headers={"Authorization": f"Bearer {key}x"})
        assert wrong.status_code == 401 and key not in wrong.text
        info = http.get("/get_server_info", headers={"Authorization": f"Bearer {key}"})
        assert info.json()["api_key"] == "<set>" and key not in info.text
    log = server.stderr_tail(chars=10_000_000)
    assert "api_key='<set>'" in log  # the start-up line that showed the key shows this instead
    assert key not in log


def test_the_server_runs_on_uvloop_and_httptools(server_factory, tiny_model):
    """The dependencies uvicorn picks up (a fifth less CPU per streamed token), and the log
    says so."""
    server = server_factory(
        "--model-path", str(tiny_model), "--max-total-tokens", "256", "--log-level", "info"
    )  # fmt: skip
    log = server.stderr_tail(chars=10_000_000)
    assert "(OpenAI API under /v1; uvloop event loop, httptools HTTP parser; 1 HTTP" in log


def test_an_idle_connection_outlives_a_clients_pool_expiry(http_server):
    """A keep-alive connection idle for longer than httpx's pool keeps one (5 s) still answers:
    the server never closes a connection that a client may be reusing at that moment."""
    conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=10)
    try:
        for wait in (0.0, 6.0):
            time.sleep(wait)
            conn.request("GET", "/health")  # on the first request's socket: no reconnect
            response = conn.getresponse()
            assert response.status == 200 and response.read() == b'{"status":"ok"}'
            assert not response.will_close
    finally:
        conn.close()


# ---- request bodies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": BIG_TEXT, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_TEXT}]}),
    ],
)
def test_health_answers_while_a_large_body_is_tokenized(http_server, path, body):
    result: dict[str, httpx.Response] = {}

    def post() -> None:
        result["response"] = httpx.post(f"{http_server.base_url}{path}", json=body, timeout=300)

    sender = threading.Thread(target=post)
    sender.start()
    latencies = []
    with httpx.Client(base_url=http_server.base_url, timeout=60) as http:
        while sender.is_alive():
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    sender.join()
    response = result["response"]
    assert response.status_code == 400  # tokenized in full, then found longer than the context
    assert "tokens" in response.json()["error"]["message"]
    assert max(latencies) < 1.0, latencies
    assert len(latencies) >= 5, "the large request finished too fast to probe /health meanwhile"


@pytest.fixture(scope="module")
def limited_server(server_factory, tiny_model) -> ServerProcess:
    return server_factory(
        "--model-path", str(tiny_model), "--max-total-tokens", "256",
        "--max-request-body-bytes", "2000",
    )  # fmt: skip


def _assert_413(status: int, body: bytes) -> None:
    assert status == 413, body
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "2000 bytes" in error["message"] and "--max-request-body-bytes" in error["message"]


def test_declared_oversized_body_gets_413_before_it_is_sent(limited_server):
    """Only the headers go out: the 413 must come without the server waiting for the body."""
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < _length(raw):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed early: {raw!r}"
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    _assert_413(int(head.split()[1]), body[: _length(raw)])


def _length(raw: bytes) -> int:
    """The Content-Length of a response's head (0 until the head has arrived)."""
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":")[1])
    return 0


def test_streamed_oversized_body_gets_413(limited_server):
    """No Content-Length (chunked upload): the limit is counted as the bytes arrive."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'", "max_tokens": 1}'

    with httpx.Client(base_url=limited_server.base_url, timeout=60) as http:
        response = http.post("/v1/completions", content=chunks())
        assert "content-length" not in response.request.headers
        _assert_413(response.status_code, response.content)
        # a body under the limit, also chunked, is served on the same server
        small = http.post("/generate", content=iter([json.dumps(GENERATE).encode()]))
        assert small.status_code == 200 and len(small.json()["output_ids"]) == 2


# ---- start-up failures and a dead scheduler -------------------------------------------------


def _only_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_missing_model_path_is_one_line_and_exit_2():
    result = _launch("--model-path", "./missing-model")
    assert result.returncode == 2, result.stderr
    assert _only_line(result.stderr) == "error: --model-path './missing-model' does not exist"


def test_model_load_error_in_the_scheduler_is_one_line_and_exit_2(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path)
    weights = next(tmp_path.glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")
    result = _launch("--model-path", str(tmp_path), "--log-level", "warning")
    assert result.returncode == 2, result.stderr
    line = _only_line(result.stderr)
    assert line.startswith("error: cannot read safetensors file") and str(weights) in line


def test_dead_scheduler_makes_the_server_exit_non_zero(server_factory, tiny_model):
    server = server_factory("--model-path", str(tiny_model), "--max-total-tokens", "256")
    os.kill(_scheduler_pid(server), signal.SIGKILL)
    start = time.monotonic()
    code = server.proc.wait(timeout=30)
    assert time.monotonic() - start < 10, "the server took too long to exit"
    assert code == 1
    log = server.stderr_tail(chars=100_000)
    assert "stopping the server (exit code 1): the scheduler process exited (code -9)" in log
