"""benchmark/bench_startup.py on the CPU: a real eager server of a tiny checkpoint is started,
timed to its first token, and its log's milestones are read back in order."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from script_import import REPO, import_script
from tiny_checkpoints import write_tiny_checkpoint


def test_phases_reads_each_milestone_from_the_log_timestamps():
    bench = import_script("benchmark/bench_startup.py")
    spawned = datetime(2026, 11, 24, 0, 45, 40).timestamp()
    log = "\n".join(
        [
            "2026-11-24 00:45:48,407 INFO replaylm.launch_server: server args: ServerArgs(...)",
            "2026-11-24 00:46:00,079 INFO [scheduler] replaylm.model_loader.loader: loaded X",
            "capturing decode CUDA graphs (full):  50%|     | 1/2",  # no stamp: skipped
            "2026-11-24 00:46:03,281 INFO [scheduler] replaylm...base: captured 35 decode CUDA "
            "graphs (full) in 3.0 s",
            "2026-11-24 00:46:04,477 INFO [scheduler] replaylm...base: captured 12 prefill CUDA "
            "graphs (breakable) in 1.0 s",
            "2026-11-24 00:46:04,520 INFO replaylm.launch_server: serving m at http://x",
        ]
    )
    assert bench.phases(log, spawned) == {
        "args": 8.41,
        "loaded": 20.08,
        "captured": 24.48,
        "serving": 24.52,
    }


def test_an_eager_cpu_server_start_is_timed_and_broken_down(tmp_path):
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
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["start"] == "cold" and row["modes"] == {"decode": "disabled", "prefill": "disabled"}
    marks = row["phases"]
    assert list(marks) == ["args", "loaded", "serving"]  # eager: nothing compiled or captured
    # log stamps have millisecond resolution: allow that much against the timer
    assert 0 < marks["args"] <= marks["loaded"] <= marks["serving"] <= row["seconds"] + 0.01
    assert Path(tmp_path / "logs" / "server_0_cold.log").read_text().count("serving") >= 1
