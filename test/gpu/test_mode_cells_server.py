"""Every cell of {decode: full, breakable, tc_piecewise, disabled} x {prefill: breakable,
tc_piecewise, disabled} through the real server (SmolLM2, bf16): 32 chat prompts, greedy, each
cell's outputs equal to the all-eager cell's for >= 98% of prompts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from server_process import start_server

DECODE = ("full", "breakable", "tc_piecewise", "disabled")
PREFILL = ("breakable", "tc_piecewise", "disabled")
QUESTIONS = [f"In one sentence, what is {t}?" for t in (
    "gravity", "a prime number", "Paris", "photosynthesis", "a neuron", "democracy", "jazz",
    "an atom", "the internet", "a volcano", "inflation", "a haiku", "DNA", "a galaxy", "tea",
    "chess", "a rainbow", "Python", "a glacier", "the moon", "an orchestra", "yeast", "a bridge",
    "a comet", "a desert", "an opera", "a vaccine", "a compass", "a tide", "a fossil", "a drum",
    "a satellite")]


async def _answers(base_url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def one(q: str) -> str:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 32,
                "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]
        return list(await asyncio.gather(*(one(q) for q in QUESTIONS)))


def _check_capture_report(base_url: str, decode: str, prefill: str) -> None:
    """/get_server_info reports each captured phase's capture (and tc_piecewise's compile)."""
    stats = httpx.get(f"{base_url}/get_server_info", timeout=10).json()["cuda_graph_capture"]
    for phase, mode in (("decode", decode), ("prefill", prefill)):
        if mode == "disabled":
            assert phase not in stats
            continue
        assert stats[phase]["mode"] == mode and stats[phase]["capture_s"] > 0
        assert (stats[phase]["compile_s"] is not None) == (mode == "tc_piecewise")


@pytest.fixture(scope="module")
def answers() -> Callable[[str, str], list[str]]:
    """The answers of the cell (decode mode, prefill mode), from a server started on first use
    (so `-k` picks which cells start servers; the eager cell always does)."""
    cache: dict[tuple[str, str], list[str]] = {}

    def get(decode: str, prefill: str) -> list[str]:
        if (decode, prefill) not in cache:
            mode = json.dumps({"decode": decode, "prefill": prefill})
            # 32 prompts at once: decode shapes up to 32 keep the captures short
            server = start_server("--cuda-graph-mode", mode, "--max-running-requests", "64",
                                  "--decode-cuda-graph-max-bs", "32",
                                  "--max-total-tokens", "20000", device="cuda")
            try:
                _check_capture_report(server.base_url, decode, prefill)
                cache[decode, prefill] = asyncio.run(_answers(server.base_url))
            finally:
                server.stop()
        return cache[decode, prefill]

    return get


@pytest.mark.parametrize("cell", [(d, p) for d in DECODE for p in PREFILL
                                  if (d, p) != ("disabled", "disabled")],
                         ids=lambda cell: f"decode_{cell[0]}-prefill_{cell[1]}")
def test_cell_matches_eager(answers, cell):
    eager = answers("disabled", "disabled")
    got = answers(*cell)
    same = sum(a == b for a, b in zip(got, eager, strict=True))
    print(f"{cell}: {same}/{len(eager)} identical to eager")
    assert same >= 0.98 * len(eager)
