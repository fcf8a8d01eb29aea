"""What the HTTP tests share: the flags and served name of conftest.py's `http_server` (the
built-in SmolLM2 on the CPU), the prompts most tests send it, and readers of a server's
answers, of its /metrics and of a `bench_serving.py` run against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m-instruct"
# a context below the KV size, so that too-long prompts are measured against the context
CONTEXT_LEN = 2048
KV_TOKENS = 4096
HTTP_SERVER_FLAGS = ("--max-total-tokens", str(KV_TOKENS), "--context-length", str(CONTEXT_LEN))
TIMEOUT_S = 120
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
TINY_API_KEY = "sekret"  # the key of test/cpu/conftest.py's `tiny_keyed_server`
BENCH_SERVING = Path(__file__).resolve().parents[1] / "benchmark" / "bench_serving.py"


def post_ok(http: httpx.Client, path: str, body: dict[str, Any]) -> dict:
    """POST `body` to `path` for MODEL; asserts a 200 (showing the error body otherwise)."""
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def samples(exposition: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, `name{labels}` -> value."""
    pairs = (line.rsplit(" ", 1) for line in exposition.splitlines() if not line.startswith("#"))
    return {key: float(value) for key, value in pairs}


def scrape(http: httpx.Client) -> dict[str, float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    return samples(response.text)


def metric(http: httpx.Client, name: str, default: float | None = None) -> float:
    """The value of one (label-less or fully labelled) series from GET /metrics; `default` when
    it is absent (a labelled series appears once its label is first used), else an error."""
    value = samples(http.get("/metrics").text).get(name, default)
    assert value is not None, f"no series {name} in /metrics"
    return value


def run_bench_serving(base_url: str, json_out: Path, *args: str) -> dict:
    """Run `bench_serving.py` against `base_url` with `args`; its JSON report, parsed."""
    subprocess.run(
        [
            sys.executable,
            str(BENCH_SERVING),
            "--base-url",
            base_url,
            *args,
            "--disable-tqdm",
            "--json",
            str(json_out),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return json.loads(json_out.read_text())
