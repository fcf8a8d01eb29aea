"""The accuracy suite's harness on the CPU: the shared eager SmolLM2 server (`http_server`,
test/conftest.py) is asked 10 gsm8k questions (the reference), then a second server running a
graph mode cell through the eager debug path (`--debug-cuda-graph`: the runners, padding and the
compiled tc_piecewise forward, no capture) is asked the same questions 5 at a time; the runs are
compared and summarised by the same functions as the GPU suite (test_mode_accuracy.py)."""

from __future__ import annotations

import json

import httpx

from eval_runs import EvalSpec, ask
from mode_compare import compare, write_summary

SPEC = EvalSpec("gsm8k", num_examples=10, num_shots=0, max_tokens=16)  # short: CPU time
CELL = {"decode": "tc_piecewise", "prefill": "breakable"}


def test_a_graph_mode_cell_agrees_with_eager(http_server, server_factory, tmp_path):
    cell = server_factory(
        "--max-total-tokens",
        "4096",
        "--context-length",
        "2048",
        "--debug-cuda-graph",
        "--cuda-graph-mode",
        json.dumps(CELL),
        "--tc-piecewise-compiler",
        "eager",
        "--decode-cuda-graph-bs",
        "1",
        "2",
        "4",
        "8",
        "--prefill-cuda-graph-tokens",
        "256",
        "1024",
    )
    reference = ask(http_server.base_url, SPEC, "eager", parallel=10)
    again = ask(cell.base_url, SPEC, "tc_piecewise/breakable (debug)", parallel=5)
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
        ("eager", 1.0, True),
        ("tc_piecewise/breakable (debug)", 1.0, True),
    ]
    assert rows[1]["accuracy"] == reference.metrics.accuracy
    metrics = httpx.get(f"{cell.base_url}/metrics", timeout=10).text
    for phase in ("decode", "prefill"):  # the questions really went through the graph path
        series = f'replaylm_forward_batches{{path="graph",phase="{phase}"}} '
        values = [
            float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(series)
        ]
        assert values and values[0] > 0, phase
