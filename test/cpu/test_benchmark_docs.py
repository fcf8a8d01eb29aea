"""docs/benchmarks.md is benchmark/render_docs.py's render of the JSON under benchmark/results/:
the committed page equals it, its tables hold the rows of their JSON (built by the scripts' own
result functions where they have one), the preferred GPU's result is the one shown, and every
result records where it came from (benchmark/common.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from script_import import REPO, import_script

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def render_docs():
    return import_script("benchmark/render_docs.py")


def environment(gpu: str = H100) -> dict:
    """common.environment()'s block of a run on `gpu`."""
    versions = {"torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "driver": None}
    run = {
        "commit": "abc1234",
        "date": "2026-12-01",
        "command": "python benchmark/bench_x.py --a 1",
    }
    return {"gpu": gpu, **versions, **run}


def write_result(results: Path, folder: str, name: str, doc: dict) -> Path:
    path = results / folder / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def sampling_doc(gpu: str, plain_ms: float) -> dict:
    """bench_sampling.py's JSON: batch sizes 1 and 4, penalties off and on."""
    rows = [
        {"bs": bs, "penalties": p, "step_ms": plain_ms * bs + (0.5 if p == "on" else 0.0)}
        for bs in (1, 4)
        for p in ("off", "on")
    ]
    return {"environment": environment(gpu), "summary": rows}


def table_lines(page: str, header: str) -> list[str]:
    """The lines of the page's table whose header line starts with `header`, separator left out."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [lines[start], *lines[start + 2 : end]]


def test_the_committed_page_is_the_render_of_the_committed_results(render_docs):
    committed = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert render_docs.render() == committed, "run: python benchmark/render_docs.py"
    assert render_docs.main(["--check"]) == 0


def test_check_fails_with_a_message_when_the_page_differs(
    render_docs, tmp_path, monkeypatch, capsys
):
    stale = tmp_path / "benchmarks.md"
    stale.write_text("# Benchmarks\n\nold numbers\n")
    monkeypatch.setattr(render_docs, "PAGE", stale)
    assert render_docs.main(["--check"]) == 1
    assert stale.read_text() == "# Benchmarks\n\nold numbers\n"
    message = capsys.readouterr().err
    assert "-old numbers" in message
    assert "benchmarks.md differs from its render of benchmark/results" in message


def test_offline_table_has_a_row_per_mode_and_server_args(render_docs, tmp_path):
    bench_offline = import_script("benchmark/bench_offline.py")
    forwards = {"decode": {"graph": 9, "eager": 0, "padding_tokens": 0}}
    full = json.dumps({"decode": "full", "prefill": "breakable"})

    def run(seconds: float, **options) -> dict:
        return bench_offline.result_row(
            "full", full, 256, 90_000, 130_000, 130_000, seconds, forwards, **options
        )

    rows = [run(40.0), run(50.0, overlap=False), run(25.0, server_args='{"tp_size": 2}')]
    results = tmp_path / "results"
    write_result(results, "h100", "offline", {"environment": environment(), "summary": rows})

    page = render_docs.render(results)

    assert table_lines(page, "| decode, server args") == [
        "| decode, server args | requests | output tokens | output tok/s, overlap on | overlap off "
        "| seconds, overlap on |",
        "| full | 256 | 130,000 | 3,250 | 2,600 | 40.000 |",
        "| full, tp_size=2 | 256 | 130,000 | 5,200 |  | 25.000 |",
    ]
    assert "- `python benchmark/bench_x.py --a 1`" in page
    assert f"- {H100}, torch 2.11.0 (CUDA 13.0), triton 3.6.0; commit `abc1234`, 2026-12-01" in page
    assert "## Sampling" not in page  # no JSON, no section


def test_one_batch_table_has_a_column_per_mode_and_kernels(render_docs, tmp_path):
    def row(step: str, mode: str, graph_ms: float, kernels: str = "fused") -> dict:
        decode = step.startswith("decode")
        timed = {"back_to_back_ms": graph_ms - 0.1} if decode else {}
        return {"model": "qwen3-0.6b", "step": step, "mode": mode, "eager_ms": 20.0, **timed} | {
            "graph_ms": graph_ms,
            "floor_ms": 0.5 if decode else None,
            "variant": "{}",
            "kernels": kernels,
        }

    rows = [
        row("decode bs8", "full", 1.5),
        row("decode bs1", "full", 1.0),
        row("decode bs1", "breakable", 2.0),
        row("prefill 1x128", "breakable", 3.0),
        row("decode bs1", "full", 4.0, kernels="native"),
    ]
    doc = {"environment": environment(), "copy_bandwidth_gbs": 3000.0, "rows": rows}
    results = tmp_path / "results"
    write_result(results, "h100", "one_batch", doc)

    assert table_lines(render_docs.render(results), "| model | step") == [
        "| model | step | eager | breakable | full | native: eager | native: full | floor "
        "| best / floor |",
        "| qwen3-0.6b | prefill 1x128 | 20.00 | 3.000 |  |  |  |  |  |",
        "| qwen3-0.6b | decode bs1 | 20.00 | 2.000 (1.900) | 1.000 (0.900) | 20.00 | 4.000 (3.900) "
        "| 0.500 | 2.00x |",
        "| qwen3-0.6b | decode bs8 | 20.00 |  | 1.500 (1.400) |  |  | 0.500 | 3.00x |",
    ]


def test_the_preferred_gpus_result_is_shown_and_the_other_named(render_docs, tmp_path):
    results = tmp_path / "results"
    write_result(results, "h100", "sampling", sampling_doc(H100, 2.0))
    shown = write_result(results, "h200", "sampling", sampling_doc("NVIDIA H200", 1.0))
    host = [{"bs": 256, "prepare_us": 300.0, "forward_us": 20.0, "step_ms": 5.0}]
    write_result(
        results, "h100", "decode_host_scale", {"environment": environment(), "summary": host}
    )

    page = render_docs.render(results)

    assert table_lines(page, "| batch") == [
        "| batch | plain ms/step | penalised ms/step | cost |",
        "| 1 | 1.000 | 1.500 | +0.500 ms (50.0%) |",
        "| 4 | 4.000 | 4.500 | +0.500 ms (12.5%) |",
    ]
    assert "NVIDIA H200" in page and H100 in page  # H100: decode_host_scale's, none other
    sampling = next(s for s in render_docs.SECTIONS if s.names == ("sampling",))
    assert render_docs.section_files(sampling, results) == [shown]
    assert render_docs.unrendered(results) == [results / "h100" / "sampling.json"]


def test_a_result_in_another_devices_folder_is_refused(render_docs, tmp_path):
    results = tmp_path / "results"
    write_result(results, "h100", "sampling", sampling_doc("NVIDIA H200", 1.0))
    with pytest.raises(SystemExit, match="measured on NVIDIA H200, so it belongs in h200/"):
        render_docs.render(results)


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        (None, "cpu"),
    ],
)
def test_gpu_slug_is_the_models_short_name(name, slug):
    assert import_script("benchmark/common.py").gpu_slug(name) == slug


def test_a_result_records_its_command_and_date(tmp_path, monkeypatch):
    common = import_script("benchmark/common.py")
    argv = ["benchmark/bench_one_batch.py", "--json", str(tmp_path / "a.json"), "--bs", "1"]
    argv += ["--model-path", str(tmp_path / "model.gguf"), f"--config={REPO}/benchmark/configs"]
    command = common.run_command(argv)
    assert command == (
        "python benchmark/bench_one_batch.py --bs 1 --model-path model.gguf "
        "--config=benchmark/configs"
    )
    assert common.run_command([str(REPO / "benchmark" / "bench_prefix.py"), "--json=x.json"]) == (
        "python benchmark/bench_prefix.py"
    )

    monkeypatch.setattr(sys, "argv", ["benchmark/bench_sampling.py", "--bs", "1"])
    out = tmp_path / "results" / "cpu" / "sampling.json"  # its folders are made
    common.write_json(out, {"summary": []})
    env = json.loads(out.read_text())["environment"]
    assert env["command"] == "python benchmark/bench_sampling.py --bs 1"
    assert len(env["date"]) == 10 and env["date"].startswith("20")

    summary = tmp_path / "accuracy.json"  # a file another tool wrote
    summary.write_text(json.dumps({"model": "m", "rows": []}))
    common.add_environment(summary, "python -m pytest test/accuracy")
    doc = json.loads(summary.read_text())
    assert doc["environment"]["command"] == "python -m pytest test/accuracy"
    assert doc["rows"] == []
