"""Accuracy with its Wilson 95% interval, invalid rate, latency and output throughput."""

from __future__ import annotations

import math
from dataclasses import dataclass

from replaylm.eval.runner import Record

Z95 = 1.959963984540054  # the 97.5th percentile of the standard normal


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion; ValueError unless 0 <= successes <= n
    and n > 0. Unlike the normal approximation it stays inside [0, 1] and is not empty at 0/n.
    It always contains successes / n (exactly: at 0/n the float lower bound would be ~1e-17)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


@dataclass(frozen=True)
class Metrics:
    num_examples: int
    correct: int
    accuracy: float
    accuracy_ci95: tuple[float, float]
    invalid: int  # no answer found in the completion, or the request failed
    invalid_rate: float
    errors: int  # requests that failed (counted in `invalid` too)
    latency_s: float  # wall clock of the whole run
    output_tokens: int  # summed over the responses' usage.completion_tokens
    output_throughput: float  # output_tokens / latency_s


def summarise(records: list[Record], latency_s: float) -> Metrics:
    """The metrics of a finished run of `records` (at least one) that took `latency_s`."""
    n = len(records)
    correct = sum(r.verdict == "correct" for r in records)
    invalid = sum(r.verdict == "invalid" for r in records)
    tokens = sum(r.completion_tokens for r in records)
    return Metrics(
        num_examples=n,
        correct=correct,
        accuracy=correct / n,
        accuracy_ci95=wilson_interval(correct, n),
        invalid=invalid,
        invalid_rate=invalid / n,
        errors=sum(r.error is not None for r in records),
        latency_s=latency_s,
        output_tokens=tokens,
        output_throughput=tokens / latency_s if latency_s > 0 else 0.0,
    )
