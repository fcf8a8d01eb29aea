"""benchmark/tuning/bench_decode_host.py in-process on the CPU with a tiny checkpoint: one row
per batch size, positive medians, the requests released after (the pools are whole again)."""

from __future__ import annotations

import json

from script_import import import_script
from tiny_checkpoints import write_tiny_checkpoint


def test_decode_host_bench_times_every_batch_size_and_releases(tmp_path):
    bench = import_script("benchmark/tuning/bench_decode_host.py")
    write_tiny_checkpoint("qwen3", tmp_path / "ckpt")
    out = tmp_path / "host.json"
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
    doc = json.loads(out.read_text())
    assert [r["bs"] for r in doc["summary"]] == [1, 3]
    for row in doc["summary"]:
        assert row["prepare_us"] > 0 and row["forward_us"] > 0
        # each step contains its prepare and forward, so its median exceeds theirs (the median
        # of the sums need not exceed the sum of the medians)
        assert row["step_ms"] * 1e3 > max(row["prepare_us"], row["forward_us"])
        assert row["context"] == 12 and row["steps"] == 4

    runner = bench.build_runner(str(tmp_path / "ckpt"), "cpu", 2, 40)

    def free() -> tuple[int, int]:
        return (runner.token_allocator.available_size(), runner.req_to_token_pool.available_size())

    before = free()
    bench.time_decode_steps(runner, 2, 12, 3)
    assert free() == before
