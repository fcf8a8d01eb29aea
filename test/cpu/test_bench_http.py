"""benchmark/bench_http.py on the CPU at a small scale: a server per front-end count under its
workload, every request served and counted, the front ends' CPU per token read for each, the
page's table built from the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from script_import import import_script

PROMPTS, OUTPUT = 8, 8


def test_each_front_end_count_is_measured_and_tabled(tmp_path):
    bench = import_script("benchmark/bench_http.py")
    out = tmp_path / "http.json"
    bench.main(
        [
            "--device", "cpu", "--no-engine", "--num-prompts", str(PROMPTS),
            "--input-len", "8", "--output-len", str(OUTPUT), "--api-server-count", "1", "2",
            "--client-processes", "1", "--json", str(out),
        ]
    )  # fmt: skip
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["api_server_count"] for r in rows] == [1, 2]
    for row in rows:
        assert row["model"] == "smollm2-135m-tiny" and row["setting"] == "http"
        assert (row["completed"], row["failed"]) == (PROMPTS, 0)
        assert row["output_tok_s"] > 0 and row["front_end_cpu_us_per_token"] > 0
    assert doc["config"]["model_path"] == ["smollm2-135m-tiny.json"]  # no path of this machine
    tables = import_script("benchmark/doc_tables.py")
    table = tables.http_table([("http", doc)])
    assert [cells[1] for cells in table.rows] == ["HTTP, 1 front end", "HTTP, 2 front ends"]


def test_a_dummy_config_gets_the_tokenizers_vocabulary_when_larger(tmp_path):
    bench = import_script("benchmark/bench_http.py")
    args = bench.parse_args(
        ["--device", "cpu", "--model-path", str(bench.CONFIGS / "qwen3-0.6b.json")]
    )
    served, cut = bench.served_config(args, args.model_path[0], tmp_path)
    config = json.loads(Path(served).read_text())
    assert cut == config["vocab_size"] == 49152  # SmolLM2's tokenizer, under Qwen3's 151,936
    assert config["hidden_size"] == 1024  # the rest is Qwen3-0.6B's
    small = bench.CONFIGS / "smollm2-135m.json"
    assert bench.served_config(bench.parse_args(["--device", "cuda"]), str(small), tmp_path) == (
        str(small),
        None,
    )
