"""benchmark/bench_http.py on the CPU at a small scale: a server per front-end count under its
workload, every request served and counted, the front ends' CPU per token read for each, the
page's table built from the JSON."""

from __future__ import annotations

import json

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
    assert doc["config"]["model_path"] == "smollm2-135m-tiny.json"  # no path of this machine
    tables = import_script("benchmark/doc_tables.py")
    table = tables.http_table([("http", doc)])
    assert [cells[1] for cells in table.rows] == ["HTTP, 1 front end", "HTTP, 2 front ends"]
