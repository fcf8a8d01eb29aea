"""Whether one CUDA-graph mode's eval run agrees with the eager run of the same questions.

A mode passes an eval when its accuracy lies inside the eager run's Wilson 95% interval, at least
`MIN_IDENTICAL` of its completions equal eager's character for character, and neither run had a
failed request (two failed requests would otherwise count as two identical empty completions).
`write_summary` writes the comparisons as JSON for benchmark/plot.py and the docs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaylm.eval.metrics import Metrics, summarise
from replaylm.eval.runner import Record

MIN_IDENTICAL = 0.98


@dataclass(frozen=True)
class EvalRun:
    """One eval asked of one server: `mode` labels the server's settings (e.g. "full/breakable"),
    `records` are in question order."""

    mode: str
    eval_name: str
    records: list[Record]
    metrics: Metrics

    @classmethod
    def of(cls, mode: str, eval_name: str, records: list[Record], wall_s: float) -> EvalRun:
        return cls(mode, eval_name, records, summarise(records, wall_s))


@dataclass(frozen=True)
class Comparison:
    """One mode against the reference (eager) run of one eval."""

    eval_name: str
    mode: str
    num_examples: int
    accuracy: float
    ci95: tuple[float, float]
    reference_accuracy: float
    reference_ci95: tuple[float, float]
    differing: tuple[int, ...]  # indices of the questions whose completions differ
    errors: int  # failed requests, both runs together

    @property
    def identical(self) -> float:
        """The fraction of completions equal to the reference's."""
        return 1 - len(self.differing) / self.num_examples

    @property
    def problems(self) -> list[str]:
        """Why the mode fails the comparison; empty when it passes."""
        lo, hi = self.reference_ci95
        found = []
        if not within(self.accuracy, self.reference_ci95):
            found.append(
                f"accuracy {self.accuracy:.3f} outside the reference's 95% interval "
                f"{lo:.3f}-{hi:.3f}"
            )
        if self.identical < MIN_IDENTICAL:
            found.append(
                f"{self.identical:.1%} of completions identical to the reference's "
                f"(need {MIN_IDENTICAL:.0%}); questions differing: "
                f"{list(self.differing[:10])}"
            )
        if self.errors:
            found.append(f"{self.errors} failed requests")
        return found

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self) -> str:
        """One line for logs: accuracy beside the reference's, identical share, verdict."""
        lo, hi = self.ci95
        verdict = "ok" if self.passed else "FAILED: " + "; ".join(self.problems)
        return (
            f"{self.eval_name} {self.mode}: accuracy {self.accuracy:.3f} ({lo:.3f}-{hi:.3f}), "
            f"reference {self.reference_accuracy:.3f}, {self.identical:.1%} identical, "
            f"{verdict}"
        )

    def row(self) -> dict[str, Any]:
        """The comparison as one JSON summary row."""
        return {
            "eval": self.eval_name,
            "mode": self.mode,
            "num_examples": self.num_examples,
            "accuracy": self.accuracy,
            "ci95": list(self.ci95),
            "reference_accuracy": self.reference_accuracy,
            "reference_ci95": list(self.reference_ci95),
            "identical": self.identical,
            "differing": list(self.differing),
            "errors": self.errors,
            "passed": self.passed,
            "problems": self.problems,
        }


def within(accuracy: float, interval: tuple[float, float]) -> bool:
    """Whether `accuracy` lies in the closed interval."""
    lo, hi = interval
    return lo <= accuracy <= hi


def differing(records: list[Record], reference: list[Record]) -> list[int]:
    """Indices of the questions whose completions differ; ValueError unless both runs asked the
    same (one or more) questions in the same order."""
    if [r.question for r in records] != [r.question for r in reference]:
        raise ValueError("the runs asked different questions")
    if not records:
        raise ValueError("the runs asked no questions")
    return [
        i
        for i, (a, b) in enumerate(zip(records, reference, strict=True))
        if a.completion != b.completion
    ]


def compare(run: EvalRun, reference: EvalRun) -> Comparison:
    """`run` against `reference` (the same eval's eager run)."""
    if run.eval_name != reference.eval_name:
        raise ValueError(f"cannot compare {run.eval_name} with {reference.eval_name}")
    return Comparison(
        eval_name=run.eval_name,
        mode=run.mode,
        num_examples=run.metrics.num_examples,
        accuracy=run.metrics.accuracy,
        ci95=run.metrics.accuracy_ci95,
        reference_accuracy=reference.metrics.accuracy,
        reference_ci95=reference.metrics.accuracy_ci95,
        differing=tuple(differing(run.records, reference.records)),
        errors=run.metrics.errors + (reference.metrics.errors if run is not reference else 0),
    )


def write_summary(path: Path, model: str, comparisons: list[Comparison]) -> None:
    """`{"model", "min_identical", "rows": [Comparison.row(), ...]}` as JSON at `path`."""
    doc = {"model": model, "min_identical": MIN_IDENTICAL, "rows": [c.row() for c in comparisons]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
