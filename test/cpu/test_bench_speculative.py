"""benchmark/bench_speculative.py in-process on the CPU with a tiny checkpoint: step rows for
decode and each verify size; replay rows (over the copying model) whose uncorrupted drafts are
all accepted and whose outputs equal plain decoding's, a corrupted replay accepting fewer; an
EAGLE-3 head's draft step; the checkpoint as its own draft model, every draft accepted."""

from __future__ import annotations

import json

from replaylm.model_loader.builtin_models import resolve_model_path

from script_import import import_script
from tiny_checkpoints import write_tiny_checkpoint, write_tiny_eagle_head


def test_speculative_bench_times_steps_and_replays(tmp_path):
    bench = import_script("benchmark/bench_speculative.py")
    target = write_tiny_checkpoint("llama3_deep", tmp_path / "ckpt")
    write_tiny_eagle_head("eagle3", tmp_path / "head", target.config, layer_ids=[0, 1, 2])
    out = tmp_path / "speculative.json"
    bench.main(
        [
            "--models",
            str(tmp_path / "ckpt"),
            "--device",
            "cpu",
            "--bs",
            "1",
            "3",
            "--verify-tokens",
            "2",
            "4",
            "--corrupt",
            "0",
            "0.5",
            "--output-len",
            "12",
            "--context",
            "16",
            "--draft-model",
            str(tmp_path / "ckpt"),
            "--head",
            str(tmp_path / "head"),
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["summary"]
    steps = [(r["bs"], r["tokens_per_request"]) for r in rows if r["part"] == "step"]
    assert steps == [(1, 1), (1, 2), (1, 4), (3, 1), (3, 2), (3, 4)]
    assert all(r["ms"] > 0 for r in rows if r["part"] == "step")
    replay = {(r["bs"], r["corrupt"]): r for r in rows if r["part"] == "replay"}
    assert set(replay) == {(1, 0.0), (1, 0.5), (3, 0.0), (3, 0.5)}
    for bs in (1, 3):
        assert replay[bs, 0.0]["identical"] and replay[bs, 0.5]["identical"]
        assert replay[bs, 0.0]["draft_acceptance"] == 1.0
        assert replay[bs, 0.0]["tokens_per_verify"] > 3.5  # k = 3: up to 4, less near the end
        assert replay[bs, 0.5]["draft_acceptance"] < 0.8
        assert replay[bs, 0.5]["tokens_per_verify"] < replay[bs, 0.0]["tokens_per_verify"]
        assert replay[bs, 0.0]["output_tok_s"] > 0 and replay[bs, 0.0]["speedup"] > 0
    head_step, draft_step = [r for r in rows if r["part"] == "draft_step" and r["bs"] == 3]
    assert draft_step["model"] == draft_step["target"] == "ckpt" and draft_step["ms"] > 0
    assert (head_step["model"], head_step["target"]) == ("head", "ckpt") and head_step["ms"] > 0
    draft = {r["bs"]: r for r in rows if r["part"] == "draft_model"}
    assert set(draft) == {1, 3}
    for row in draft.values():
        assert row["identical"] and row["tokens_per_verify"] > 3.5
    # the page's table: a row per run, a column per batch size
    tables = import_script("benchmark/doc_tables.py")
    table = tables.speculative_table([("speculative", json.loads(out.read_text()))])
    assert table.header == ["model", "drafter", "drafts", "timed", "bs 1", "bs 3", "equals plain"]
    assert [r[1] for r in table.rows] == ["replay, 0.0% corrupted", "replay, 50.0% corrupted"] + [
        "draft model"
    ]
    first = replay[1, 0.0]
    assert table.rows[0][4] == f"{first['speedup']:.2f}x ({first['tokens_per_verify']:.2f})"
    assert all(r[-1] == "yes" for r in table.rows)
    assert "(head for ckpt)" in table.note and "(ckpt for ckpt)" in table.note


def test_speculative_bench_runs_the_ngram_drafter_on_smollm2(tmp_path):
    bench = import_script("benchmark/bench_speculative.py")
    out = tmp_path / "speculative.json"
    bench.main(
        ["--models", "--draft-model", "", "--head", "", "--ngram-model-path"]
        + [resolve_model_path("smollm2-135m-instruct")]
        + ["--device", "cpu", "--bs", "2", "--ngram-steps", "2", "4", "--output-len", "24"]
        + ["--ngram-prompts", "2"]
        + ["--json", str(out)]
    )
    rows = json.loads(out.read_text())["summary"]
    assert [(r["part"], r["bs"], r["steps"]) for r in rows] == [("ngram", 2, 2), ("ngram", 2, 4)]
    for row in rows:
        assert row["model"] == "SmolLM2-135M-Instruct" and row["identical"]
        assert row["tokens_per_verify"] >= 1.0 and row["output_tok_s"] > 0
