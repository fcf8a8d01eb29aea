"""benchmark/plot.py on small synthetic inputs in the real formats: built by the scripts' own
result functions where they have one (bench_serving, bench_offline, the accuracy suite), the keys
of bench_one_batch and bench_startup mirrored."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from script_import import import_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def one_batch_doc() -> dict:
    """bench_one_batch.py's JSON (rows as bench_model builds them)."""
    rows = []
    for model in ("qwen3-0.6b", "llama-3.1-8b"):
        for step, eager_ms in (("prefill 1x128", 9.0), ("prefill 8x256", 20.0)):
            rows += [
                {
                    "model": model,
                    "step": step,
                    "mode": mode,
                    "eager_ms": eager_ms,
                    "graph_ms": graph_ms,
                    "floor_ms": None,
                    "speedup": eager_ms / graph_ms,
                }
                for mode, graph_ms in (("breakable", 2.0), ("tc_piecewise", 1.5))
            ]
        for step, eager_ms in (("decode bs1", 35.0), ("decode bs64", 38.0)):
            rows += [
                {
                    "model": model,
                    "step": step,
                    "mode": mode,
                    "eager_ms": eager_ms,
                    "graph_ms": graph_ms,
                    "floor_ms": 0.4,
                    "speedup": eager_ms / graph_ms,
                }
                for mode, graph_ms in (("full", 4.1), ("breakable", 4.3), ("tc_piecewise", 3.0))
            ]
    variant = json.dumps({"small_batch_matmul": "triton"})  # a second kernel variant's rows
    rows += [{**r, "variant": variant, "graph_ms": r["graph_ms"] * 0.9} for r in rows[:5]]
    rows += [{**r, "kernels": "native", "graph_ms": r["graph_ms"] * 1.2} for r in rows[:5]]
    return {"copy_bandwidth_gbs": 3000.0, "rows": rows, "captures": [], "summary": []}


def serving_doc(bench_serving, scale: float) -> dict:
    """bench_serving.py's JSON, its summary rows from its own `summarize`."""
    args = bench_serving.parse_args(["--num-prompts", "2"])
    results = [
        bench_serving.RequestResult(
            ok=True,
            input_len=8,
            output_len=4,
            ttft=0.02 * scale,
            latency=0.1 * scale,
            itl=[0.01 * scale] * 3,
        )
    ] * 2
    summary = [
        bench_serving.summarize(
            args, "m", "plain", rate, concurrency, bench_serving.RunResult(results, 1.0 * scale)
        )
        for rate, concurrency in ((math.inf, None), (4.0, None), (math.inf, 8))
    ]
    return {"config": {}, "summary": summary, "requests": []}


def offline_doc(bench_offline) -> dict:
    """bench_offline.py's JSON, its rows from its own `result_row`."""
    forwards = {
        "decode": {"graph": 9, "eager": 1, "padding_tokens": 3},
        "prefill": {"graph": 2, "eager": 0, "padding_tokens": 40},
    }
    rows = [
        bench_offline.result_row(
            mode,
            json.dumps({"decode": mode, "prefill": "breakable"}),
            256,
            100_000,
            130_000,
            130_000,
            seconds,
            forwards,
        )
        for mode, seconds in (("full", 40.0), ("breakable", 45.0), ("disabled", 200.0))
    ]
    return {"config": {"model_path": str(bench_offline.QWEN3_CONFIG)}, "summary": rows}


def startup_doc() -> dict:
    """bench_startup.py's JSON."""
    cells = [
        ("disabled", "disabled", "cold", 8.0),
        ("full", "breakable", "cold", 12.0),
        ("tc_piecewise", "tc_piecewise", "cold", 60.0),
        ("tc_piecewise", "tc_piecewise", "warm", 20.0),
    ]
    rows = [
        {
            "modes": {"decode": d, "prefill": p},
            "start": s,
            "seconds": sec,
            "of_tc_piecewise_cold": sec / 60.0,
        }
        for d, p, s, sec in cells
    ]
    summary = [{"decode": d, "prefill": p, "start": s, "seconds": sec} for d, p, s, sec in cells]
    return {"model_path": "qwen3-0.6b.json", "rows": rows, "summary": summary}


def accuracy_doc(path: Path) -> None:
    """The accuracy suite's summary, written by its own `write_summary`."""
    mode_compare = import_script("test/accuracy/mode_compare.py")
    made = [
        mode_compare.Comparison(
            name, mode, n, acc, (acc - 0.05, acc + 0.05), 0.3, (0.25, 0.35), tuple(range(diff)), 0
        )
        for name, n in (("gsm8k", 200), ("mgsm_en", 250))
        for mode, acc, diff in (
            ("disabled/disabled", 0.3, 0),
            ("full/breakable", 0.3, 2),
            ("tc_piecewise/disabled", 0.2, 30),
        )
    ]
    mode_compare.write_summary(path, "smollm2-135m-instruct", made)


def test_every_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = import_script("benchmark/plot.py")
    bench_serving = import_script("benchmark/bench_serving.py")
    inputs = {
        "one_batch.json": one_batch_doc(),
        "serving_full.json": serving_doc(bench_serving, 1.0),
        "serving_eager.json": serving_doc(bench_serving, 3.0),
        "offline.json": offline_doc(import_script("benchmark/bench_offline.py")),
        "startup.json": startup_doc(),
    }
    for name, doc in inputs.items():
        (tmp_path / name).write_text(json.dumps(doc))
    accuracy_doc(tmp_path / "accuracy.json")
    out = tmp_path / "img"

    written = plot.main(
        [
            "--one-batch",
            str(tmp_path / "one_batch.json"),
            "--serving",
            str(tmp_path / "serving_full.json"),
            str(tmp_path / "serving_eager.json"),
            "--offline",
            str(tmp_path / "offline.json"),
            str(tmp_path / "missing.json"),
            "--startup",
            str(tmp_path / "startup.json"),
            "--accuracy",
            str(tmp_path / "accuracy.json"),
            "--out",
            str(out),
        ]
    )

    names = [
        "one_batch_qwen3-0.6b.png",
        "one_batch_llama-3.1-8b.png",
        "serving.png",
        "offline.png",
        "startup.png",
        "accuracy.png",
    ]
    assert written == [out / n for n in names]
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, path
    printed = capsys.readouterr().out
    assert f"skipped {tmp_path / 'missing.json'}: no such file" in printed
    assert printed.count("wrote ") == len(names)


def test_serving_runs_are_grouped_by_rate_then_concurrency():
    pytest.importorskip("matplotlib")
    plot = import_script("benchmark/plot.py")
    bench_serving = import_script("benchmark/bench_serving.py")
    docs = [("a", serving_doc(bench_serving, 1.0)), ("b", serving_doc(bench_serving, 2.0))]
    assert plot.serving_runs(docs) == [
        ("plain", 4.0, None),
        ("plain", "inf", 8),
        ("plain", "inf", None),
    ]


def test_only_missing_inputs_write_nothing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = import_script("benchmark/plot.py")
    assert (
        plot.main(["--startup", str(tmp_path / "bench_startup.json"), "--out", str(tmp_path)]) == []
    )
    assert "no plots written" in capsys.readouterr().out


def test_without_matplotlib_it_exits_with_one_line(monkeypatch):
    loaded = [name for name in sys.modules if name.startswith("matplotlib.")]
    for name in ["matplotlib", *loaded]:  # `import matplotlib...` now fails
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as exit_info:
        import_script("benchmark/plot.py")
    message = exit_info.value.code
    assert message == "benchmark/plot.py needs matplotlib: pip install -e '.[bench]'"


def test_one_batch_series_name_their_kernel_variant():
    pytest.importorskip("matplotlib")
    plot = import_script("benchmark/plot.py")
    assert plot._variant_label({"mode": "full"}) == ""
    assert plot._variant_label({"variant": "{}"}) == ""
    pdl = json.dumps({"small_batch_matmul": "triton", "enable_pdl": True})
    assert plot._variant_label({"variant": pdl}) == " [small_batch_matmul=triton, enable_pdl=True]"
    assert plot._variant_label({"variant": "{}", "kernels": "fused"}) == ""
    assert plot._variant_label({"variant": "{}", "kernels": "native"}) == " [kernels=native]"


def test_serving_groups_are_labelled_by_what_bounds_them():
    pytest.importorskip("matplotlib")
    plot = import_script("benchmark/plot.py")
    assert plot._serving_label(("plain", "inf", 32)) == "32 in flight"
    assert plot._serving_label(("plain", 4.0, None)) == "4.0 req/s"
    assert plot._serving_label(("plain", 4.0, 8)) == "4.0 req/s,\n8 in flight"
    assert plot._serving_label(("json_schema", "inf", 8)) == "json_schema\n8 in flight"
