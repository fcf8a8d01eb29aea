"""Speculative decoding on CUDA (bfloat16, triton attention) with the built-in SmolLM2: the
n-gram drafter and SmolLM2 as its own draft model, verify steps under every mode the verify
phase takes (full, breakable, tc_piecewise, disabled) beside full and breakable decode graphs.
Greedy outputs must equal the same server's without speculation for most prompts, every
divergence at a near-tie (bf16: a verify step's matmuls have more rows than a decode step's and
may round apart); the verify phase must run from its graphs where it has them, and drafts must
be accepted. Under --deterministic the outputs are plain decoding's exactly.
"""

from __future__ import annotations

import json

import pytest

from replaylm.cuda_graph_modes import DISABLED, modes_serving
from replaylm.entrypoints.engine import Engine
from replaylm.model_loader.builtin_models import resolve_model_path

from model_parity import divergence_gaps

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.5
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. To be or not to be, that is the question. All that glitters is not gold."
)
TOPICS = ["rivers", "the moon", "bread", "chess", "volcanoes", "music", "bees", "trains"]
VERIFY = (*modes_serving("verify"), DISABLED)
DECODE = ("full", "breakable")
DRAFTERS = ("ngram", "draft_model")
GREEDY = {"max_new_tokens": 64, "temperature": 0.0}


def _engine(
    decode: str, verify: str | None = None, drafter: str | None = None, **flags: object
) -> Engine:
    modes = {"decode": decode, "prefill": "breakable"}
    extra: dict[str, object] = {}
    if drafter is not None:
        modes["verify"] = verify or DISABLED
        extra["speculative_algorithm"] = drafter
        if drafter == "draft_model":
            extra["speculative_draft_model_path"] = resolve_model_path("smollm2-135m-instruct")
    return Engine(
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=60000,
        max_running_requests=32,
        cuda_graph_mode=json.dumps(modes),
        **extra,
        **flags,
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    engine = _engine("full")
    chats = [f"Repeat this passage word for word:\n\n{PASSAGE}"] + [
        f"Write two sentences about {t}, then repeat them word for word." for t in TOPICS
    ]
    ids = [engine.encode_chat([{"role": "user", "content": c}]) for c in chats]
    engine.shutdown()
    return ids


@pytest.fixture(scope="module", params=DECODE)
def plain(request, prompts):
    """The same server without speculation: its runner and greedy outputs."""
    engine = _engine(request.param)
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    yield request.param, engine, [o["output_ids"] for o in out]
    engine.shutdown()


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("verify", VERIFY)
def test_speculation_equals_plain_decoding_in_every_verify_mode(plain, prompts, verify, drafter):
    decode, reference, want = plain
    engine = _engine(decode, verify, drafter)
    try:
        out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        got = [o["output_ids"] for o in out]
        gaps = divergence_gaps(reference.runner, prompts, got, want)
        assert len(gaps) <= len(prompts) // 2, gaps
        assert all(gap < NEAR_TIE for gap in gaps.values()), gaps
        stats = engine.scheduler.speculation.stats
        assert stats.accepted > 0
        verify_counts = engine.runner.forward_stats.phases["verify"]
        if verify != DISABLED:
            assert verify_counts.graph > 0
        else:
            assert verify_counts.graph == 0 and verify_counts.eager > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_deterministic_speculation_gives_plain_decodings_tokens_exactly(prompts, drafter):
    """Under --deterministic a verify row runs the decode kernels over its own KV length with
    batch-invariant matmuls, so which drafts come and are kept cannot change a token."""
    plain = _engine("full", deterministic=True)
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    plain.shutdown()
    engine = _engine("full", "full", drafter, deterministic=True)
    try:
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert got == want
        assert engine.scheduler.speculation.stats.accepted > 0
    finally:
        engine.shutdown()
