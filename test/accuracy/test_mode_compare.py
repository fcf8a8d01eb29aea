"""The comparison rules of the accuracy suite on synthetic runs, graded by the real gsm8k grader:
they pass what should pass and fail what should fail."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from replaylm.eval.base import Example
from replaylm.eval.client import Reply
from replaylm.eval.gsm8k import Gsm8k
from replaylm.eval.runner import grade

from mode_compare import MIN_IDENTICAL, EvalRun, compare, differing, within, write_summary

N = 50
GSM8K = Gsm8k([Example(f"question {i}", Decimal(i)) for i in range(N)], shots=[])


def run_of(mode: str, correct: int, reworded: int = 0, failed: int = 0) -> EvalRun:
    """A run whose first `correct` answers are right and the rest wrong; the last `reworded`
    completions are worded differently (same answer), the first `failed` requests failed."""
    records = []
    for i, example in enumerate(GSM8K.examples):
        answer = i if i < correct else i + 1
        text = f"thus {answer}" if i >= N - reworded else f"The answer is {answer}"
        error = "HTTP 500: boom" if i < failed else None
        reply = Reply("" if error else text, None if error else "stop", 4, 0.1, error)
        records.append(grade(i, example, GSM8K.prompt(example), reply, GSM8K))
    return EvalRun.of(mode, GSM8K.name, records, wall_s=1.0)


REFERENCE = run_of("disabled/disabled", correct=25)  # 95% interval ~0.37-0.63


def test_the_same_run_passes():
    c = compare(REFERENCE, REFERENCE)
    assert c.passed and c.identical == 1.0 and c.differing == ()
    assert c.accuracy == c.reference_accuracy == 0.5


def test_98_percent_identical_passes_and_less_fails():
    one_off = compare(run_of("full/breakable", correct=25, reworded=1), REFERENCE)
    assert one_off.identical == 49 / 50 >= MIN_IDENTICAL and one_off.passed
    two_off = compare(run_of("full/breakable", correct=25, reworded=2), REFERENCE)
    assert two_off.identical == 48 / 50 < MIN_IDENTICAL
    assert two_off.differing == (48, 49)
    (problem,) = two_off.problems  # the accuracy is the reference's
    assert "96.0% of completions identical" in problem and "[48, 49]" in problem


def test_accuracy_outside_the_reference_interval_fails():
    lo, hi = REFERENCE.metrics.accuracy_ci95
    inside = compare(run_of("breakable/disabled", correct=24), REFERENCE)
    assert within(inside.accuracy, (lo, hi))
    assert [p for p in inside.problems if "accuracy" in p] == []
    low = compare(run_of("breakable/disabled", correct=10), REFERENCE)
    assert low.accuracy == 0.2 < lo and not low.passed
    assert any(
        p.startswith("accuracy 0.200 outside the reference's 95% interval") for p in low.problems
    )
    high = compare(run_of("breakable/disabled", correct=40), REFERENCE)
    assert high.accuracy == 0.8 > hi and not high.passed


def test_failed_requests_fail_even_when_both_runs_fail_alike():
    broken = run_of("full/disabled", correct=25, failed=1)
    c = compare(broken, run_of("disabled/disabled", correct=25, failed=1))
    assert c.identical == 1.0 and within(c.accuracy, c.reference_ci95)
    assert c.errors == 2 and c.problems == ["2 failed requests"]
    assert compare(broken, broken).errors == 1  # a run against itself counts once


def test_runs_of_different_questions_or_evals_cannot_be_compared():
    with pytest.raises(ValueError, match="different questions"):
        differing(REFERENCE.records[:10], REFERENCE.records[:9])
    with pytest.raises(ValueError, match="no questions"):
        differing([], [])
    other = EvalRun("x", "mgsm_en", REFERENCE.records, REFERENCE.metrics)
    with pytest.raises(ValueError, match="cannot compare mgsm_en with gsm8k"):
        compare(other, REFERENCE)


def test_summary_json_holds_every_comparison(tmp_path):
    made = [compare(REFERENCE, REFERENCE), compare(run_of("full/breakable", 10, 3), REFERENCE)]
    path = tmp_path / "sub" / "accuracy.json"
    write_summary(path, "tiny", made)
    doc = json.loads(path.read_text())
    assert doc["model"] == "tiny" and doc["min_identical"] == MIN_IDENTICAL
    assert doc["rows"] == [c.row() for c in made]
    ok, bad = doc["rows"]
    assert ok["passed"] and ok["problems"] == [] and ok["identical"] == 1.0
    assert (bad["eval"], bad["mode"], bad["num_examples"]) == ("gsm8k", "full/breakable", N)
    assert not bad["passed"] and len(bad["problems"]) == 2
    assert bad["accuracy"] == 0.2 and bad["reference_accuracy"] == 0.5
    assert bad["ci95"][0] < 0.2 < bad["ci95"][1] and bad["differing"][-3:] == [47, 48, 49]
