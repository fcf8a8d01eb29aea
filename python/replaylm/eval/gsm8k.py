"""GSM8K few-shot over the completions endpoint (the format of the lm-eval/SGLang gsm8k runs).

Prompt: `num_shots` train examples, each "Question: <q>\\nAnswer: <train solution>\\n\\n" (the
solution as written, `<<calc>>` annotations and "#### n" line included), then
"Question: <q>\\nAnswer:". Greedy, stopped at the next "Question:". The answer is the last
number of the completion; the reference is the number after "####" in the test solution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from decimal import Decimal

from replaylm.eval.answers import last_number, parse_reference
from replaylm.eval.base import Endpoint, Example
from replaylm.eval.data import DataError, default_data_dir, read_jsonl, sibling

DEFAULT_SHOTS = 5


@dataclass(frozen=True)
class Shot:
    """A solved train example shown before the question."""

    question: str
    solution: str


@dataclass
class Gsm8k:
    examples: list[Example]
    shots: list[Shot]
    name: str = "gsm8k"
    endpoint: Endpoint = "completions"
    stop: list[str] = field(default_factory=lambda: ["Question:"])

    @classmethod
    def load(cls, data_path: str | None, num_shots: int | None, seed: int) -> Gsm8k:
        """Test questions from `data_path` (default: the shipped gsm8k/test.jsonl); the shots are
        `num_shots` (default 5) train examples drawn with `seed` from train.jsonl beside it."""
        test = data_path or str(default_data_dir() / "gsm8k" / "test.jsonl")
        num_shots = DEFAULT_SHOTS if num_shots is None else num_shots
        examples = [Example(q, _reference(s, test)) for q, s in _pairs(test)]
        shots: list[Shot] = []
        if num_shots:
            train = [Shot(q, s) for q, s in _pairs(sibling(test, "train.jsonl"))]
            if num_shots > len(train):
                raise DataError(f"--num-shots {num_shots} exceeds the {len(train)} train examples")
            shots = random.Random(seed).sample(train, num_shots)
        return cls(examples, shots)

    @property
    def num_shots(self) -> int:
        return len(self.shots)

    def prompt(self, example: Example) -> str:
        context = "".join(f"Question: {s.question}\nAnswer: {s.solution}\n\n" for s in self.shots)
        return f"{context}Question: {example.question}\nAnswer:"

    def parse(self, completion: str) -> Decimal | None:
        return last_number(completion)


def _pairs(location: str) -> list[tuple[str, str]]:
    rows = read_jsonl(location)
    for n, row in enumerate(rows, 1):
        if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
            raise DataError(f"{location} record {n}: expected string fields question and answer")
    return [(row["question"], row["answer"]) for row in rows]


def _reference(solution: str, location: str) -> Decimal:
    try:
        return parse_reference(solution.rsplit("####", 1)[1])
    except (IndexError, ValueError):
        raise DataError(
            f"{location}: a solution does not end in '#### <number>': {solution[-80:]!r}"
        ) from None
