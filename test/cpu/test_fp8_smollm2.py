"""The built-in SmolLM2-135M-Instruct in FP8 against itself unquantized, on the shipped gsm8k
questions as text: weights and activations quantized at load (`--quantization fp8`, emulated on
the CPU exactly as the GPU path rounds), and the FP8 KV cache. Perplexity stays within 3% and the
top-1 token agrees on most positions."""

from __future__ import annotations

import pytest

from replaylm.entrypoints.engine import Engine

from text_scoring import Scores, gsm8k_questions, score_texts

TEXTS = 24  # about 1,500 scored positions


def _scores(**kwargs: object) -> Scores:
    engine = Engine(device="cpu", max_total_tokens=8192, max_running_requests=32, **kwargs)
    return score_texts(engine, gsm8k_questions(TEXTS))


@pytest.fixture(scope="module")
def reference() -> Scores:
    return _scores()


@pytest.mark.parametrize(
    "fp8",
    [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}],
    ids=["weights", "kv_cache"],
)
def test_fp8_keeps_perplexity_and_top1(reference: Scores, fp8: dict[str, str]) -> None:
    got = _scores(**fp8)
    assert len(got.logprobs) == len(reference.logprobs) > 1000
    assert abs(got.perplexity / reference.perplexity - 1) < 0.03
    assert got.top1_agreement(reference) > 0.85
