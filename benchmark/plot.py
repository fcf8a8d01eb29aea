"""PNG plots of the benchmark and accuracy JSON files (matplotlib's Agg renderer, no display).

    python benchmark/plot.py [--one-batch A.json ...] [--serving B.json ...] [--offline C.json ...]
        [--startup D.json ...] [--accuracy E.json ...]
        [--serving-rates F.json ... [--labels NAME ...]] [--out docs/img]

Each flag takes one or more files; a missing file is skipped with a message. When a flag has
several files, each bar series is named by its file's stem (e.g. serving runs of two servers).

  --one-batch  bench_one_batch.py: prefill and decode latency, eager and per mode
               -> one_batch_<model>.png
  --serving    bench_serving.py: output throughput, TTFT and ITL (p50, whisker to p99) per
               request rate -> serving.png
  --offline    bench_offline.py: output tok/s per mode, beside nano-vllm's published numbers for
               its Qwen3-0.6B workload -> offline.png
  --startup    bench_startup.py: seconds from launch to first token per mode, cold and warm
               -> startup.png
  --accuracy   test/accuracy's summary: accuracy per mode with its 95% interval, the eager run's
               interval shaded, the share of completions identical to eager's on each bar; one
               panel per eval -> accuracy.png
  --serving-rates
               bench_serving.py over several request rates: ITL p99, TTFT p50 and output tok/s
               against the request rate (log scales; `inf`, all at once, drawn right of the
               highest rate), one line per file (and per workload and max concurrency in it), so
               that servers run with and without a flag compare on one figure; `--labels` names
               the files' lines in order (default: their stems) -> serving_rates.png

Needs matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure
except ImportError:
    sys.exit("benchmark/plot.py needs matplotlib: pip install -e '.[bench]'")

Doc = tuple[str, dict[str, Any]]  # (the file's stem, its JSON)
Series = dict[str, list[float | None]]  # bar series name -> one value per group (None: no bar)
Whiskers = dict[str, list[tuple[float, float]]]  # series name -> (below, above) per group

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "img"
NANO_VLLM_REFERENCE = {  # nano-vllm's README: Qwen3-0.6B, 256 seqs, RTX 4070 Laptop (8 GB)
    "nano-vllm (RTX 4070 Laptop)": 1434,
    "vLLM (RTX 4070 Laptop)": 1362,
}


def load(paths: list[Path], names: list[str] | None = None) -> list[Doc]:
    """The JSON of every path that exists, named by `names` (in order; default: the stems); a
    message for each that does not exist."""
    docs = []
    for path, name in zip(paths, names or [p.stem for p in paths], strict=True):
        if path.is_file():
            docs.append((name, json.loads(path.read_text(encoding="utf-8"))))
        else:
            print(f"skipped {path}: no such file")
    return docs


def grouped_bars(
    ax: Axes, groups: list[str], series: Series, ylabel: str, whiskers: Whiskers | None = None
) -> list[BarContainer]:
    """One cluster of bars per group, one bar per series (returned in order); a legend when
    there are several."""
    width = 0.8 / len(series)
    bars = []
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        yerr = None
        if whiskers and name in whiskers:
            yerr = [[w[0] for w in whiskers[name]], [w[1] for w in whiskers[name]]]
        bars.append(
            ax.bar(
                [g + offset for g in range(len(groups))],
                [math.nan if v is None else v for v in values],
                width,
                label=name,
                yerr=yerr,
                capsize=3,
            )
        )
    ax.set_xticks(
        range(len(groups)),
        groups,
        rotation=30 if len(groups) > 4 else 0,
        ha="right" if len(groups) > 4 else "center",
    )
    ax.set_ylabel(ylabel)
    if len(series) > 1:
        ax.legend(fontsize="small")
    return bars


def _name(stem: str, name: str, docs: list[Doc]) -> str:
    """A series name, prefixed by its file's stem when several files were given."""
    return f"{stem} {name}" if len(docs) > 1 else name


def _mode_label(row: dict[str, Any]) -> str:
    return f"{row['decode']} / {row['prefill']}"


def _variant_label(row: dict[str, Any]) -> str:
    """ " [key=value, ...]" of a bench_one_batch row's ServerArgs variant and its kernels where
    native; "" for neither."""
    fields = json.loads(row.get("variant") or "{}")
    if row.get("kernels") == "native":
        fields["kernels"] = "native"
    return f" [{', '.join(f'{k}={v}' for k, v in fields.items())}]" if fields else ""


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    return path


def plot_one_batch(docs: list[Doc], out: Path) -> list[Path]:
    """Per model: prefill and decode step latency, eager beside each mode's graph replay."""
    rows = [(stem, r) for stem, doc in docs for r in doc["rows"]]
    written = []
    for model in dict.fromkeys(r["model"] for _, r in rows):
        fig = Figure(figsize=(11, 4.5), layout="constrained")
        fig.suptitle(f"{model}: one batch, eager vs CUDA-graph modes (lower is better)")
        for ax, phase in zip(fig.subplots(1, 2), ("prefill", "decode"), strict=True):
            mine = [(s, r) for s, r in rows if r["model"] == model and r["step"].startswith(phase)]
            steps = list(dict.fromkeys(r["step"] for _, r in mine))
            series: Series = {}
            for stem, r in mine:
                variant = _variant_label(r)
                for name, ms in (
                    (f"eager{variant}", r["eager_ms"]),
                    (f"{r['mode']}{variant}", r["graph_ms"]),
                ):
                    values = series.setdefault(_name(stem, name, docs), [None] * len(steps))
                    values[steps.index(r["step"])] = ms
            if steps:
                grouped_bars(ax, steps, series, "ms per step (log)")
                ax.set_yscale("log")
            ax.set_title(phase)
        written.append(_save(fig, out / f"one_batch_{model}.png"))
    return written


def _rate(value: float | str) -> float:
    return float(value)  # "inf" -> inf


def _up_to(row: dict[str, Any], key: str, upper: str) -> tuple[float, float]:
    """A whisker from the bar `row[key]` up to `row[upper]` (none when either is missing)."""
    if row.get(key) is None or row.get(upper) is None:
        return 0.0, 0.0
    return 0.0, row[upper] - row[key]


ServingRun = tuple[str, Any, int | None]


def _serving_run(row: dict[str, Any]) -> ServingRun:
    """A bench_serving summary row's run: (workload, request rate, max concurrency or None)."""
    return row.get("workload", "plain"), row["request_rate"], row.get("max_concurrency")


def serving_runs(docs: list[Doc]) -> list[ServingRun]:
    """Every run in the docs, by workload, rate, then concurrency (uncapped last)."""
    return sorted(
        {_serving_run(r) for _, doc in docs for r in doc["summary"]},
        key=lambda run: (run[0], _rate(run[1]), run[2] or math.inf),
    )


def _serving_label(run: ServingRun) -> str:
    workload, rate, concurrency = run
    prefix = "" if workload == "plain" else f"{workload}\n"
    if concurrency and math.isinf(_rate(rate)):
        return f"{prefix}{concurrency} in flight"  # all sent at once, the concurrency bounds
    return prefix + f"{rate} req/s" + (f",\n{concurrency} in flight" if concurrency else "")


def plot_serving(docs: list[Doc], out: Path) -> list[Path]:
    """Output throughput, TTFT and ITL per run (request rate, max concurrency); one series per
    file."""
    runs = serving_runs(docs)
    groups = [_serving_label(run) for run in runs]
    fig = Figure(figsize=(max(13.0, 1.4 * len(runs) * 3), 4.5), layout="constrained")
    fig.suptitle("serving: per request rate and concurrency")
    panels = (
        ("output_token_throughput", None, "output tok/s"),
        ("p50_ttft_ms", "p99_ttft_ms", "TTFT ms (p50, to p99)"),
        ("p50_itl_ms", "p99_itl_ms", "inter-token latency ms (p50, to p99)"),
    )
    for ax, (key, upper, ylabel) in zip(fig.subplots(1, 3), panels, strict=True):
        series: Series = {}
        whiskers: Whiskers = {}
        for stem, doc in docs:
            by_run = {_serving_run(r): r for r in doc["summary"]}
            name = stem if len(docs) > 1 else "serving"
            series[name] = [by_run[run][key] if run in by_run else None for run in runs]
            if upper:
                whiskers[name] = [_up_to(by_run.get(run, {}), key, upper) for run in runs]
        grouped_bars(ax, groups, series, ylabel, whiskers)
    return [_save(fig, out / "serving.png")]


RATE_PANELS = (  # --serving-rates: (summary key, y label, log scale)
    ("p99_itl_ms", "ITL p99 ms (log)", True),
    ("p50_ttft_ms", "TTFT p50 ms (log)", True),
    ("output_token_throughput", "output tok/s", False),
)
RateLine = dict[float, dict[str, Any]]  # request rate (inf included) -> its summary row


def rate_lines(docs: list[Doc]) -> dict[str, RateLine]:
    """The docs' runs as lines over the request rate: one per file and (workload, max
    concurrency), named by the file and, where not plain and uncapped, by those."""
    lines: dict[str, RateLine] = {}
    for name, doc in docs:
        for row in doc["summary"]:
            workload, rate, concurrency = _serving_run(row)
            parts = [workload] if workload != "plain" else []
            parts += [f"{concurrency} in flight"] if concurrency else []
            label = f"{name} [{', '.join(parts)}]" if parts else name
            lines.setdefault(label, {})[_rate(rate)] = row
    return lines


def rate_positions(rates: set[float]) -> dict[float, float]:
    """Where each rate is drawn on the x axis: finite rates at themselves, inf at twice the
    highest (1 when there is none)."""
    finite = [r for r in rates if math.isfinite(r)]
    far = 2 * max(finite) if finite else 1.0
    return {r: r if math.isfinite(r) else far for r in rates}


def plot_serving_rates(docs: list[Doc], out: Path) -> list[Path]:
    """ITL p99, TTFT p50 and output tok/s against the request rate, a line per file (and per
    workload and concurrency in it)."""
    lines = rate_lines(docs)
    where = rate_positions({rate for line in lines.values() for rate in line})
    ticks = sorted(where)
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    fig.suptitle("serving: latency and throughput per request rate (Poisson; inf: all at once)")
    for ax, (key, ylabel, log) in zip(fig.subplots(1, len(RATE_PANELS)), RATE_PANELS, strict=True):
        for label, line in lines.items():
            rates = sorted(line)
            values = [line[r].get(key) for r in rates]
            ax.plot(
                [where[r] for r in rates],
                [math.nan if v is None else v for v in values],
                marker="o",
                label=label,
            )
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xticks([where[r] for r in ticks], [f"{r:g}" for r in ticks])
        ax.set_xticks([], minor=True)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return [_save(fig, out / "serving_rates.png")]


def _mode_bars(
    docs: list[Doc], key: str, series_of: Callable[[dict[str, Any]], str], ylabel: str
) -> tuple[Any, Figure]:
    """One bar group per mode (decode / prefill) of the docs' summary rows: `row[key]` in the
    series `series_of(row)`. Returns (axes, figure)."""
    rows = [(stem, r) for stem, doc in docs for r in doc["summary"]]
    labels = list(dict.fromkeys(_mode_label(r) for _, r in rows))
    series: Series = {}
    for stem, r in rows:
        values = series.setdefault(_name(stem, series_of(r), docs), [None] * len(labels))
        values[labels.index(_mode_label(r))] = r[key]
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    grouped_bars(ax, labels, series, ylabel)
    return ax, fig


def plot_offline(docs: list[Doc], out: Path) -> list[Path]:
    """Output tok/s per mode; nano-vllm's and vLLM's numbers drawn when the workload is theirs."""
    ax, fig = _mode_bars(
        docs,
        "output_throughput",
        lambda r: "output tok/s" + ("" if r.get("overlap", True) else ", no overlap"),
        "output tok/s",
    )
    if any(Path(doc["config"]["model_path"]).name == "qwen3-0.6b.json" for _, doc in docs):
        for (name, value), style in zip(NANO_VLLM_REFERENCE.items(), ("--", ":"), strict=True):
            ax.axhline(value, color="gray", linestyle=style, label=name)
        ax.legend(fontsize="small")
    ax.set_title("offline throughput per mode (decode / prefill)")
    return [_save(fig, out / "offline.png")]


def plot_startup(docs: list[Doc], out: Path) -> list[Path]:
    """Seconds from launch to the first token per mode, a bar per start (cold, warm)."""
    ax, fig = _mode_bars(docs, "seconds", lambda r: r["start"], "seconds to first token")
    ax.set_title("server start per mode (decode / prefill)")
    return [_save(fig, out / "startup.png")]


def plot_accuracy(docs: list[Doc], out: Path) -> list[Path]:
    """Per eval: accuracy per mode with its 95% interval, the reference (eager) interval shaded,
    each bar labelled with the share of completions identical to the reference's. A mode found
    in several files keeps its last row."""
    rows = {(r["eval"], r["mode"]): r for _, doc in docs for r in doc["rows"]}
    evals = list(dict.fromkeys(e for e, _ in rows))
    panel_width = max(6.0, 0.6 * max(sum(e == name for e, _ in rows) for name in evals))
    fig = Figure(figsize=(panel_width * len(evals), 4.5), layout="constrained")
    fig.suptitle(f"accuracy per CUDA-graph mode ({docs[-1][1]['model']})")
    for ax, name in zip(fig.subplots(1, len(evals), squeeze=False)[0], evals, strict=True):
        mine = [r for (e, _), r in rows.items() if e == name]
        lo, hi = mine[0]["reference_ci95"]
        ax.axhspan(lo, hi, color="gray", alpha=0.2, label="eager 95% interval")
        (bars,) = grouped_bars(
            ax,
            [r["mode"] for r in mine],
            {"accuracy": [r["accuracy"] for r in mine]},
            "accuracy",
            {
                "accuracy": [
                    (r["accuracy"] - r["ci95"][0], r["ci95"][1] - r["accuracy"]) for r in mine
                ]
            },
        )
        ax.bar_label(
            bars,
            [f"{r['identical']:.0%} same" for r in mine],
            fontsize="x-small",
            label_type="center",
            rotation=90,
        )
        ax.set_title(f"{name} ({mine[0]['num_examples']} questions)")
        ax.legend(fontsize="small")
    return [_save(fig, out / "accuracy.png")]


PLOTTERS: dict[str, Callable[[list[Doc], Path], list[Path]]] = {
    "one_batch": plot_one_batch,
    "serving": plot_serving,
    "offline": plot_offline,
    "startup": plot_startup,
    "accuracy": plot_accuracy,
    "serving_rates": plot_serving_rates,
}


def main(argv: list[str] | None = None) -> list[Path]:
    """Write every plot whose inputs exist; returns the PNG paths written."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for kind in PLOTTERS:
        parser.add_argument(
            f"--{kind.replace('_', '-')}", nargs="+", type=Path, default=[], metavar="JSON"
        )
    parser.add_argument(
        "--labels", nargs="+", default=None, help="--serving-rates: a line name per file, in order"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: docs/img")
    args = parser.parse_args(argv)
    if not any(getattr(args, kind) for kind in PLOTTERS):
        flags = ", ".join(f"--{kind.replace('_', '-')}" for kind in PLOTTERS)
        parser.error(f"give at least one input ({flags})")
    if args.labels is not None and len(args.labels) != len(args.serving_rates):
        parser.error("--labels: one name per --serving-rates file")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, plotter in PLOTTERS.items():
        docs = load(getattr(args, kind), args.labels if kind == "serving_rates" else None)
        if docs:
            written += plotter(docs, args.out)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("no plots written: none of the inputs exist")
    return written


if __name__ == "__main__":
    main()
