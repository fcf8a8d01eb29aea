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


def serving_rates_doc(bench_serving, itl_ms: float) -> dict:
    """bench_serving.py's JSON of a rate sweep (--rate-seconds), its rows from `summarize`: the
    ITL grows with the rate, `itl_ms` at 1 req/s."""
    args = bench_serving.parse_args(["--random-dist", "lognormal", "--rate-seconds", "10"])
    summary = []
    for rate in (4.0, 16.0, 64.0, math.inf):
        gap = itl_ms / 1e3 * (1 + min(rate, 128.0) / 16)
        results = [
            bench_serving.RequestResult(
                ok=True, input_len=8, output_len=4, ttft=2 * gap, latency=5 * gap, itl=[gap] * 3
            )
        ] * 4
        summary.append(
            bench_serving.summarize(
                args, "m", "plain", rate, None, bench_serving.RunResult(results, 1.0)
            )
        )
    return {"config": vars(args) | {"request_rate": ["4", "16", "64", "inf"]}, "summary": summary}


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
        "rates_defaults.json": serving_rates_doc(bench_serving, 5.0),
        "rates_flag.json": serving_rates_doc(bench_serving, 4.0),
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
            "--serving-rates",
            str(tmp_path / "rates_defaults.json"),
            str(tmp_path / "rates_flag.json"),
            "--labels",
            "defaults",
            "enable-mixed-chunk",
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
        "serving_rates.png",
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


def test_serving_rates_draw_a_line_per_file_and_inf_right_of_the_highest_rate():
    pytest.importorskip("matplotlib")
    plot = import_script("benchmark/plot.py")
    bench_serving = import_script("benchmark/bench_serving.py")
    capped = serving_doc(bench_serving, 1.0)  # a run at 8 in flight among uncapped ones
    docs = [("defaults", serving_rates_doc(bench_serving, 5.0)), ("capped", capped)]
    lines = plot.rate_lines(docs)
    assert list(lines) == ["defaults", "capped", "capped [8 in flight]"]
    assert sorted(lines["defaults"]) == [4.0, 16.0, 64.0, math.inf]
    assert sorted(lines["capped"]) == [4.0, math.inf]
    assert list(lines["capped [8 in flight]"]) == [math.inf]
    itl = [lines["defaults"][r]["p99_itl_ms"] for r in (4.0, 16.0, 64.0, math.inf)]
    assert itl == sorted(itl) and itl[0] == 5.0 * 1.25
    where = plot.rate_positions({4.0, 16.0, 64.0, math.inf})
    assert where == {4.0: 4.0, 16.0: 16.0, 64.0: 64.0, math.inf: 128.0}
    assert plot.rate_positions({math.inf}) == {math.inf: 1.0}


def test_serving_rates_labels_name_the_files_in_order_missing_ones_included(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = import_script("benchmark/plot.py")
    bench_serving = import_script("benchmark/bench_serving.py")
    (tmp_path / "b.json").write_text(json.dumps(serving_rates_doc(bench_serving, 4.0)))
    docs = plot.load([tmp_path / "a.json", tmp_path / "b.json"], ["off", "on"])
    assert [name for name, _ in docs] == ["on"]
    assert f"skipped {tmp_path / 'a.json'}" in capsys.readouterr().out
    written = plot.main(
        ["--serving-rates", str(tmp_path / "b.json"), "--labels", "on", "--out", str(tmp_path)]
    )
    assert written == [tmp_path / "serving_rates.png"]
    assert written[0].read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(SystemExit):
        plot.main(["--serving-rates", str(tmp_path / "b.json"), "--labels", "x", "y"])
    assert "--labels: one name per --serving-rates file" in capsys.readouterr().err
