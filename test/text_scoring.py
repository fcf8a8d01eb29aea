"""Score a model on the project's own text: each position's log-probability of the actual next
token and the model's top-1 token there, through the engine's prompt logprobs. Quantized
models and caches are compared to the unquantized one with these (perplexity, top-1
agreement)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

GSM8K_TEST = Path(__file__).parents[1] / "python/replaylm/eval/datasets/gsm8k/test.jsonl"


def gsm8k_questions(count: int) -> list[str]:
    """The first `count` questions of the shipped gsm8k test set, as plain text."""
    with GSM8K_TEST.open() as f:
        return [json.loads(line)["question"] for _, line in zip(range(count), f, strict=False)]


@dataclass
class Scores:
    logprobs: list[float]  # of the actual next token, every scored position
    top1: list[int]  # the model's most likely token at those positions

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))

    def top1_agreement(self, other: Scores) -> float:
        same = sum(a == b for a, b in zip(self.top1, other.top1, strict=True))
        return same / len(self.top1)


def score_texts(engine: Engine, texts: list[str]) -> Scores:
    """Every position after the first of each text, scored in one request per text."""
    reqs = [
        Req(
            f"score-{i}",
            engine.tokenizer(text)["input_ids"],
            SamplingParams(max_new_tokens=1, temperature=0.0),
            0,
            1,
            prompt_logprobs=1,
        )
        for i, text in enumerate(texts)
    ]
    found: dict[str, list] = {}
    for req in reqs:
        engine.scheduler.add(req)
    while not all(req.finished for req in reqs):
        for out in engine.scheduler.step():
            if out.prompt_logprobs is not None:
                found[out.req.rid] = out.prompt_logprobs
    engine.scheduler.run_to_completion()
    scores = Scores([], [])
    for req in reqs:
        for entry in found[req.rid]:
            if entry is None:  # the first token has no prediction
                continue
            scores.logprobs.append(entry.logprob)
            scores.top1.append(entry.top[0][0])
    return scores
