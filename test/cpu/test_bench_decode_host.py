"""benchmark/tuning/bench_decode_host.py in-process on the CPU with a tiny checkpoint: one row
per batch size, positive medians, the requests released after (the pools are whole again), more
requests than a server's default 256 prefilled over several batches, and a KV cache too small
for the requests refused before anything runs."""

from __future__ import annotations

import json

import pytest

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
        return (runner.kv.allocator.available_size(), runner.kv.req_to_token.available_size())

    before = free()
    bench.time_decode_steps(runner, 2, 12, 3)
    assert free() == before


def test_decode_host_bench_runs_more_requests_than_one_prefill_batch(tmp_path):
    bench = import_script("benchmark/tuning/bench_decode_host.py")
    write_tiny_checkpoint("qwen3", tmp_path / "ckpt")
    # 2048 // 8 = 256 requests per prefill batch: 300 take two, and run decode steps together
    runner = bench.build_runner(str(tmp_path / "ckpt"), "cpu", 300, 8 + bench.WARMUP + 2 + 8)
    assert bench.PREFILL_CHUNK // 8 == 256
    free = runner.kv.req_to_token.available_size()
    row = bench.time_decode_steps(runner, 300, 8, 2)
    assert row["prepare_us"] > 0 and row["forward_us"] > 0 and row["step_ms"] > 0
    assert runner.kv.req_to_token.available_size() == free == 300


def test_decode_host_bench_refuses_a_kv_cache_short_of_the_requests(tmp_path):
    bench = import_script("benchmark/tuning/bench_decode_host.py")
    write_tiny_checkpoint("qwen3", tmp_path / "ckpt")
    # the CPU's KV cache is 1 GiB, 2M tokens of 512 bytes here: 2 requests of 3M tokens do not fit
    argv = ["--model-path", str(tmp_path / "ckpt"), "--device", "cpu", "--bs", "2"]
    with pytest.raises(SystemExit, match="lower --context or --steps"):
        bench.main([*argv, "--context", "3000000", "--steps", "4"])
