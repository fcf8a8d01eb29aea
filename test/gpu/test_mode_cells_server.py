"""Every cell of {decode: full, breakable, tc_piecewise, disabled} x {prefill: breakable,
tc_piecewise, disabled} through the real server (SmolLM2, bf16): 64 chat prompts, greedy, each
cell's outputs equal to the all-eager cell's, every divergence at a near-tie: where the two
answers part, the top-2 logprob gap (= the logit gap) is reported and must be small (bf16
rounding differs between the modes' kernels and batch shapes and may flip a near-tie). Under
98% identical, a cell is an expected failure (xfail) when every divergence is a near-tie.

The same server then runs the sampling features (cell_features.py: n=3, echo with prompt
logprobs, logit_bias, JSON schema, a forced tool call, penalties, streaming): each does what it
promises in every cell, and its prompt logprobs match the eager cell's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from cell_features import CellFeatures, cell_features, check_definitions, compare_with_eager

from replaylm.cuda_graph_modes import DISABLED, modes_serving

from server_process import start_server

pytestmark = pytest.mark.gpu

DECODE = (*modes_serving("decode"), DISABLED)
PREFILL = (*modes_serving("prefill"), DISABLED)
QUESTIONS = [
    f"In one sentence, what is {t}?"
    for t in (
        "gravity",
        "a prime number",
        "Paris",
        "photosynthesis",
        "a neuron",
        "democracy",
        "jazz",
        "an atom",
        "the internet",
        "a volcano",
        "inflation",
        "a haiku",
        "DNA",
        "a galaxy",
        "tea",
        "chess",
        "a rainbow",
        "Python",
        "a glacier",
        "the moon",
        "an orchestra",
        "yeast",
        "a bridge",
        "a comet",
        "a desert",
        "an opera",
        "a vaccine",
        "a compass",
        "a tide",
        "a fossil",
        "a drum",
        "a satellite",
        "a rainforest",
        "an earthquake",
        "a battery",
        "a telescope",
        "a hurricane",
        "a library",
        "a mammal",
        "an island",
        "a violin",
        "a magnet",
        "a cloud",
        "a recipe",
        "a pyramid",
        "a river",
        "a skeleton",
        "a thermometer",
        "a microscope",
        "an alphabet",
        "a calendar",
        "a lighthouse",
        "an echo",
        "a seed",
        "a planet",
        "a poem",
        "a robot",
        "an ocean",
        "a market",
        "a castle",
        "a whale",
        "a mirror",
        "a language",
        "a forest",
    )
]
NEAR_TIE = 0.5  # top-2 logit gap under which bf16 rounding may flip a greedy choice


@dataclass
class Answer:
    content: str
    tokens: list[str]  # the generated tokens, as the server's logprobs name them
    gaps: list[float]  # per token: top-1 minus top-2 logprob before it was chosen


def _parse(choice: dict) -> Answer:
    steps = choice["logprobs"]["content"]
    gaps = [
        top[0]["logprob"] - top[1]["logprob"]
        if len(top := step["top_logprobs"]) > 1
        else float("inf")
        for step in steps
    ]
    return Answer(choice["message"]["content"], [step["token"] for step in steps], gaps)


async def _answers(base_url: str) -> list[Answer]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(q: str) -> Answer:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": q}],
                    "max_tokens": 32,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": 2,
                },
            )
            r.raise_for_status()
            return _parse(r.json()["choices"][0])

        return list(await asyncio.gather(*(one(q) for q in QUESTIONS)))


def _parting_gap(got: Answer, want: Answer) -> float:
    """The top-2 gap where two answers' tokens first differ (the reference's, else `got`'s;
    inf when neither has a token there)."""
    k = next(
        (i for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)) if a != b),
        min(len(got.tokens), len(want.tokens)),
    )
    for answer in (want, got):
        if k < len(answer.gaps):
            return answer.gaps[k]
    return float("inf")


def _check_capture_report(base_url: str, decode: str, prefill: str) -> None:
    """/get_server_info reports each captured phase's capture (and tc_piecewise's compile)."""
    stats = httpx.get(f"{base_url}/get_server_info", timeout=10).json()["cuda_graph_capture"]
    for phase, mode in (("decode", decode), ("prefill", prefill)):
        if mode == "disabled":
            assert phase not in stats
            continue
        assert stats[phase]["mode"] == mode and stats[phase]["capture_s"] > 0
        assert (stats[phase]["compile_s"] is not None) == (mode == "tc_piecewise")


@dataclass
class Cell:
    answers: list[Answer]
    features: CellFeatures


@pytest.fixture(scope="module")
def cells() -> Callable[[str, str], Cell]:
    """The answers and features of the cell (decode mode, prefill mode), from a server started
    on first use (so `-k` picks which cells start servers; the eager cell always does)."""
    cache: dict[tuple[str, str], Cell] = {}

    def get(decode: str, prefill: str) -> Cell:
        if (decode, prefill) not in cache:
            mode = json.dumps({"decode": decode, "prefill": prefill})
            # 64 prompts at once: decode shapes up to 32 keep the captures short (larger batches
            # run eagerly until enough requests have finished)
            server = start_server(
                "--cuda-graph-mode",
                mode,
                "--max-running-requests",
                "64",
                "--decode-cuda-graph-max-bs",
                "32",
                "--max-total-tokens",
                "20000",
                device="cuda",
            )
            try:
                _check_capture_report(server.base_url, decode, prefill)
                answers = asyncio.run(_answers(server.base_url))
                cache[decode, prefill] = Cell(answers, cell_features(server.base_url))
            finally:
                server.stop()
        return cache[decode, prefill]

    return get


@pytest.mark.parametrize(
    "cell",
    [(d, p) for d in DECODE for p in PREFILL if (d, p) != ("disabled", "disabled")],
    ids=lambda cell: f"decode_{cell[0]}-prefill_{cell[1]}",
)
def test_cell_matches_eager(cells, cell):
    eager = cells("disabled", "disabled").answers
    got = cells(*cell).answers
    gaps = {
        i: _parting_gap(a, b)
        for i, (a, b) in enumerate(zip(got, eager, strict=True))
        if a.content != b.content
    }
    same = len(eager) - len(gaps)
    print(
        f"{cell}: {same}/{len(eager)} identical to eager; top-2 gaps where they part: "
        + ", ".join(f"prompt {i} {g:.3f}" for i, g in gaps.items())
    )
    assert all(g <= NEAR_TIE for g in gaps.values()), gaps
    if same < 0.98 * len(eager):
        # a server's batches depend on arrival timing, so padded graph shapes and eager batches
        # round bf16 logits differently from run to run and flip exact ties. Measured on the
        # H100: 61-64/64 per cell, every divergence at a top-2 gap of
        # 0.000-0.125; the 32-prompt version of this test passed or failed on one tie
        pytest.xfail(f"{same}/{len(eager)} identical, every divergence at a near-tie")


@pytest.mark.parametrize(
    "cell", [(d, p) for d in DECODE for p in PREFILL], ids=lambda c: f"decode_{c[0]}-prefill_{c[1]}"
)
def test_cell_features(cells, cell):
    got = cells(*cell).features
    check_definitions(got)
    compare_with_eager(got, cells("disabled", "disabled").features)
