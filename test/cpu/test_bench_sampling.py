"""benchmark/bench_sampling.py in-process on the CPU with a tiny checkpoint: an off and an on row
per batch size, positive step times, the on row's overhead measured against the off row, and
the requests' memory freed after each run."""

from __future__ import annotations

import json

from script_import import import_script
from tiny_checkpoints import write_tiny_checkpoint


def test_sampling_bench_times_penalties_off_and_on(tmp_path):
    bench = import_script("benchmark/bench_sampling.py")
    write_tiny_checkpoint("qwen3", tmp_path / "ckpt")
    out = tmp_path / "sampling.json"
    bench.main(
        [
            "--model-path",
            str(tmp_path / "ckpt"),
            "--device",
            "cpu",
            "--bs",
            "1",
            "3",
            "--context",
            "12",
            "--steps",
            "4",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["summary"]
    assert [(r["bs"], r["penalties"]) for r in rows] == [
        (1, "off"),
        (1, "on"),
        (3, "off"),
        (3, "on"),
    ]
    for off, on in zip(rows[::2], rows[1::2], strict=True):
        assert off["step_ms"] > 0 and on["step_ms"] > 0 and off["overhead_ms"] == 0
        assert on["overhead_ms"] == round(on["step_ms"] - off["step_ms"], 4)

    runner = bench.build_runner(str(tmp_path / "ckpt"), "cpu", 2, 40)

    def free() -> tuple[int, int]:
        return (runner.kv.allocator.available_size(), runner.kv.req_to_token.available_size())

    before = free()
    sched = bench.bench_scheduler(runner)
    assert bench.time_decode(sched, 2, 12, 3, "on") > 0
    assert free() == before
    assert sched.logit_adjuster.memory_bytes > 0  # the on run used the penalty state
