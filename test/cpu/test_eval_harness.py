"""The eval harness against a real replaylm server (the built-in SmolLM2-135M on CPU, the shared
`http_server` of conftest.py): gsm8k, 4 questions, 2 shots. It checks that the run is complete
and self-consistent, not how good the model is."""

from __future__ import annotations

import json
from decimal import Decimal

import httpx

from replaylm.eval.run_eval import main

# the CPU budget: the harness, not the model, is under test
NUM_EXAMPLES, NUM_SHOTS, MAX_TOKENS = 4, 2, 96
TOKENS_PER_REQUEST = 720  # a 2-shot prompt (under 620 tokens for seed 0) plus MAX_TOKENS


def test_gsm8k_against_a_real_server(http_server, tmp_path, capsys):
    info = httpx.get(f"{http_server.base_url}/get_server_info", timeout=10).json()
    # no more requests in flight than the KV cache holds at once: beyond that the scheduler
    # retracts and recomputes long prompts, which on CPU costs minutes
    parallel = max(1, min(NUM_EXAMPLES, info["max_total_tokens"] // TOKENS_PER_REQUEST))
    dump, metrics = tmp_path / "dump.jsonl", tmp_path / "metrics.json"
    rc = main(
        [
            "--base-url",
            f"{http_server.base_url}/v1",
            "--eval-name",
            "gsm8k",
            "--num-examples",
            str(NUM_EXAMPLES),
            "--num-shots",
            str(NUM_SHOTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--parallel",
            str(parallel),
            "--dump",
            str(dump),
            "--json",
            str(metrics),
            "--no-progress",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "accuracy" in out and "smollm2-135m-instruct" in out

    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(NUM_EXAMPLES))
    assert [r["error"] for r in records] == [None] * NUM_EXAMPLES, err
    shots = records[0]["prompt"].rsplit("Question: ", 1)[0]
    assert shots.count("Question: ") == NUM_SHOTS
    for r in records:
        assert r["prompt"] == f"{shots}Question: {r['question']}\nAnswer:"  # the same shots
        assert "Question:" not in r["completion"]  # the stop string was honoured
        assert 0 < r["completion_tokens"] <= MAX_TOKENS
        assert r["finish_reason"] in ("stop", "length")
        if r["finish_reason"] == "length":
            assert r["completion_tokens"] == MAX_TOKENS
        if r["parsed"] is None:
            assert r["verdict"] == "invalid"
        else:
            same = Decimal(r["parsed"]) == Decimal(r["reference"])
            assert r["verdict"] == ("correct" if same else "incorrect")

    m = json.loads(metrics.read_text())["metrics"]
    assert m["num_examples"] == NUM_EXAMPLES and m["errors"] == 0
    assert m["correct"] == sum(r["verdict"] == "correct" for r in records)
    assert m["invalid"] == sum(r["verdict"] == "invalid" for r in records)
    assert m["accuracy"] == m["correct"] / NUM_EXAMPLES
    lo, hi = m["accuracy_ci95"]
    assert 0 <= lo <= m["accuracy"] <= hi <= 1 and hi - lo > 0
    assert m["output_tokens"] == sum(r["completion_tokens"] for r in records)
    assert m["output_throughput"] > 0 and m["latency_s"] > 0
