"""The accuracy suite's harness on the CPU, where only eager runs: the shared SmolLM2 server
(`http_server`, test/conftest.py) is asked 10 gsm8k questions all at once (the reference) and
again 5 at a time (the "mode under test": other batches, the same greedy outputs), then compared
and summarised by the same functions as the GPU suite (test_mode_accuracy.py)."""

from __future__ import annotations

import json

from eval_runs import EvalSpec, ask
from mode_compare import compare, write_summary

SPEC = EvalSpec("gsm8k", num_examples=10, num_shots=0, max_tokens=16)  # short: CPU time


def test_eager_runs_with_other_batches_agree(http_server, tmp_path):
    reference = ask(http_server.base_url, SPEC, "eager, 10 in flight", parallel=10)
    again = ask(http_server.base_url, SPEC, "eager, 5 in flight", parallel=5)
    for run in (reference, again):
        assert run.eval_name == "gsm8k" and run.metrics.num_examples == SPEC.num_examples
        assert [r.error for r in run.records] == [None] * SPEC.num_examples
        assert all(0 < r.completion_tokens <= SPEC.max_tokens for r in run.records)
        assert sum(r.completion.strip() != "" for r in run.records) >= SPEC.num_examples // 2

    made = [compare(reference, reference), compare(again, reference)]
    assert all(c.passed for c in made), [c.line() for c in made]
    path = tmp_path / "accuracy.json"
    write_summary(path, "smollm2-135m-instruct", made)
    rows = json.loads(path.read_text())["rows"]
    assert [(r["mode"], r["identical"], r["passed"]) for r in rows] == [
        ("eager, 10 in flight", 1.0, True), ("eager, 5 in flight", 1.0, True)]
    assert rows[1]["accuracy"] == reference.metrics.accuracy
