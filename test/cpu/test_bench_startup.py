"""benchmark/bench_startup.py on the CPU: a real eager server of a tiny checkpoint is started
(cold, then warm), timed to its first token, and its start-up stages (from /get_server_info) are
checked against the clock outside, against each other and against the server's log."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from script_import import REPO, import_script
from tiny_checkpoints import write_tiny_checkpoint

HTTP_STAGES = [
    "imports and arguments",
    "spawn scheduler",
    "front-end imports",
    "tokenizer",
    "tokenizer info",
    "wait for the model",
    "HTTP app",
    "HTTP ready",
]
SCHEDULER_STAGES = [
    "spawn",
    "imports",
    "device init",
    "model config",
    "model build",
    "weights read",
    "weights to device",
    "KV allocation",
    "runner setup",
    "wait for the tokenizer",
    "scheduler",
]
_LOG_STAGE = re.compile(
    r"(\[scheduler\] )?replaylm\.startup_stages: startup stage (.+): ([\d.]+) s"
)


def _doc(process: str, started_at: float, stages: list[tuple[str, float]]) -> dict:
    return {
        "process": process,
        "started_at": started_at,
        "stages": [{"name": n, "seconds": s, "cpu_s": s / 2} for n, s in stages],
        "total_s": sum(s for _, s in stages),
    }


def test_timeline_orders_both_processes_stages_by_their_end():
    bench = import_script("benchmark/bench_startup.py")
    http = _doc("http", 100.25, [("imports", 0.5), ("wait for the model", 3.0), ("ready", 0.25)])
    scheduler = _doc("scheduler", 100.75, [("spawn", 0.5), ("weights", 2.0)])
    rows = bench.timeline([http, scheduler], spawned=100.0, first_token_s=4.5)
    assert [(r["process"], r["name"], r["end_s"]) for r in rows] == [
        ("bench", "spawn", 0.25),
        ("http", "imports", 0.75),
        ("scheduler", "spawn", 1.25),
        ("scheduler", "weights", 3.25),
        ("http", "wait for the model", 3.75),
        ("http", "ready", 4.0),
        ("bench", "first token", 4.5),
    ]
    assert rows[-1]["seconds"] == 0.5 and rows[-1]["cpu_s"] is None


def test_a_first_token_at_once_comes_after_stages_whose_rounding_adds_up_past_the_total():
    bench = import_script("benchmark/bench_startup.py")
    # two stages of 0.0015 s round to 0.002 each, their 0.003 s total to 0.003: the rounded
    # stages add up to a tick past the total the process reports
    http = _doc("http", 100.0, [("imports", 0.002), ("ready", 0.002)])
    http["total_s"] = 0.003
    rows = bench.timeline([http], spawned=100.0, first_token_s=0.0035)
    assert [r["name"] for r in rows] == ["spawn", "imports", "ready", "first token"]
    assert rows[-1]["seconds"] == 0.0
    assert rows[-1]["end_s"] == pytest.approx(0.004)


def test_a_cpu_server_start_is_explained_stage_by_stage(tmp_path):
    write_tiny_checkpoint("qwen3", tmp_path / "tiny")
    out = tmp_path / "startup.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmark" / "bench_startup.py"),
            "--model-path",
            str(tmp_path / "tiny"),
            "--load-format",
            "auto",
            "--device",
            "cpu",
            "--modes",
            '{"decode": "disabled", "prefill": "disabled"}',
            "--log-dir",
            str(tmp_path / "logs"),
            "--no-bytecode-cache",  # the stages are the subject; compiling every package is not
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["start"] for r in rows] == ["cold", "warm"]
    for row in rows:
        assert row["modes"] == {"decode": "disabled", "prefill": "disabled"}
        log = (tmp_path / "logs" / f"server_0_{row['start']}.log").read_text()
        _check_stages(row["stages"], row["seconds"], log)


def _check_stages(stages: list[dict], seconds: float, log: str) -> None:
    """A start's stages (bench_startup's timeline) in order, adding up, and in its `log`."""
    by_process = {p: [r for r in stages if r["process"] == p] for p in ("bench", "http")}
    by_process["scheduler"] = [r for r in stages if r["process"] == "scheduler"]
    assert [r["name"] for r in by_process["http"]] == HTTP_STAGES
    assert [r["name"] for r in by_process["scheduler"]] == SCHEDULER_STAGES
    assert [r["name"] for r in by_process["bench"]] == ["spawn", "first token"]
    assert all(r["seconds"] >= 0 and (r["cpu_s"] or 0) >= 0 for r in stages)
    assert [r["end_s"] for r in stages] == sorted(r["end_s"] for r in stages)
    # the front process's stages, from the spawn to the answer, add up to the time measured
    # outside it
    front = by_process["bench"][:1] + by_process["http"] + by_process["bench"][1:]
    assert sum(r["seconds"] for r in front) == pytest.approx(seconds, abs=0.01)
    assert stages[-1] is by_process["bench"][-1]
    # the scheduler's stages start when the HTTP process spawned it and end within its wait
    http = {r["name"]: r for r in by_process["http"]}
    spawning, waited = http["spawn scheduler"], http["wait for the model"]
    child_start = by_process["scheduler"][0]["end_s"] - by_process["scheduler"][0]["seconds"]
    assert spawning["end_s"] - spawning["seconds"] - 0.01 <= child_start <= spawning["end_s"]
    assert by_process["scheduler"][-1]["end_s"] <= waited["end_s"] + 0.01
    # every stage's log line, each process's in order, with the seconds reported
    logged = [(bool(m[1]), m[2], float(m[3])) for m in _LOG_STAGE.finditer(log)]
    for process, child in (("http", False), ("scheduler", True)):
        reported = [(r["name"], pytest.approx(r["seconds"], abs=6e-3)) for r in by_process[process]]
        assert [(name, s) for in_child, name, s in logged if in_child == child] == reported
