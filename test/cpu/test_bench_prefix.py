"""benchmark/bench_prefix.py in-process on the CPU: a tiny checkpoint, both workloads at a small
scale, each with the prefix cache on and off. The prompts are built as documented, every token
is counted, and the cache changes no greedy output."""

from __future__ import annotations

import json

from script_import import import_script
from tiny_checkpoints import write_tiny_checkpoint

N, PREFIX, SUFFIX, OUT = 5, 40, 6, 5  # shared_prefix
CONVERSATIONS, TURNS, USER = 3, 3, 7  # multi_turn


def test_workload_prompts_share_a_prefix_and_grow_by_each_answer():
    common = import_script("benchmark/common.py")
    ids = iter(range(10_000))

    def draw(n: int) -> list[int]:
        return [next(ids) for _ in range(n)]

    prompts = common.shared_prefix_prompts(draw, 3, 4, 2)
    assert prompts == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 7], [0, 1, 2, 3, 8, 9]]
    answers, messages = [[90, 91], [92]], [[80], [81, 82]]
    assert common.next_turn_prompts([[1, 2], [3]], answers, messages) == [
        [1, 2, 90, 91, 80],
        [3, 92, 81, 82],
    ]


def test_prefix_bench_counts_every_token_and_the_cache_changes_no_output(tmp_path):
    bench = import_script("benchmark/bench_prefix.py")
    write_tiny_checkpoint("qwen3", tmp_path / "ckpt")
    out = tmp_path / "prefix.json"
    runs = bench.main(
        [
            "--model-path",
            str(tmp_path / "ckpt"),
            "--load-format",
            "auto",  # the checkpoint's weights: logits far apart, no near-ties to flip
            "--device",
            "cpu",
            "--output-len",
            str(OUT),
            "--num-requests",
            str(N),
            "--prefix-len",
            str(PREFIX),
            "--suffix-len",
            str(SUFFIX),
            "--conversations",
            str(CONVERSATIONS),
            "--turns",
            str(TURNS),
            "--user-len",
            str(USER),
            "--json",
            str(out),
        ]
    )

    doc = json.loads(out.read_text())
    assert doc["config"]["num_requests"] == N and doc["config"]["cache"] == ["on", "off"]
    rows = doc["summary"]
    assert [(r["workload"], r["cache"]) for r in rows] == [
        (w, c) for w in ("shared_prefix", "multi_turn") for c in (True, False)
    ]
    assert [(r.workload, r.cache) for r in runs] == [(r["workload"], r["cache"]) for r in rows]
    # turn t's prompt: turn t-1's, its answer and a new user message
    turn_lens = [(t + 1) * USER + t * OUT for t in range(TURNS)]
    prompt_lens = {
        "shared_prefix": [PREFIX + SUFFIX] * N,
        "multi_turn": [n for n in turn_lens for _ in range(CONVERSATIONS)],
    }
    for run, row in zip(runs, rows, strict=True):
        assert run.prompt_lens == prompt_lens[run.workload]
        assert all(len(ids) == OUT for ids in run.output_ids)
        assert row["requests"] == len(run.prompt_lens)
        assert row["prompt_tokens"] == sum(run.prompt_lens)
        assert row["output_tokens"] == OUT * row["requests"]
        assert row["cached_tokens"] == sum(run.cached)
        assert 0 <= row["cached_tokens"] <= row["prompt_tokens"]
        if not row["cache"]:
            assert row["cached_tokens"] == 0 and row["speedup"] is None
        elif run.workload == "shared_prefix":  # every request after the first finds the prefix
            assert row["cached_tokens"] >= (N - 1) * PREFIX
        else:  # each turn finds at least the conversation's previous prompt
            assert row["cached_tokens"] >= CONVERSATIONS * sum(turn_lens[:-1])
        assert row["cache_hit_rate"] == round(row["cached_tokens"] / row["prompt_tokens"], 4)
        assert row["seconds"] > 0 and row["output_throughput"] > 0
        assert row["request_throughput"] == round(row["requests"] / run.seconds, 2)
        assert row["identical_outputs"] == 1.0
    for on, off in (runs[0:2], runs[2:4]):
        assert on.output_ids == off.output_ids  # greedy: the cache changes no token
    for on, off in (rows[0:2], rows[2:4]):
        assert on["speedup"] == round(off["seconds"] / on["seconds"], 3)
