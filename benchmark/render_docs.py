"""docs/benchmarks.md from the results committed under benchmark/results/<gpu>/.

    python benchmark/render_docs.py            rewrite docs/benchmarks.md
    python benchmark/render_docs.py --check    exit 1 when the committed page differs from it
    python benchmark/render_docs.py --plots    also redraw the page's plots (benchmark/plot.py)

Every section renders one benchmark: its JSON `<name>.json` (serving: one per server mode) from
the first GPU folder of GPU_PREFERENCE that holds it (the CPU's folder for the CPU's sections),
a paragraph on what its table shows, the command, GPU, versions, commit and date its JSON
records, the table, and its plot where it has one. The numbers all come from the JSON; a JSON
that no section renders is named on stderr.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, RESULTS, gpu_slug

PAGE = REPO / "docs" / "benchmarks.md"
IMAGES = PAGE.parent / "img"
CPU = gpu_slug(None)
GPU_PREFERENCE = ("h200", "h100")  # the GPU the project measures on first: its result is shown
MODE_ORDER = ("disabled", "breakable", "tc_piecewise", "full")  # --cuda-graph-mode values
SERVING_MODES = ("full/breakable", "breakable/breakable", "tc_piecewise/tc_piecewise")

Doc = dict[str, Any]
Row = dict[str, Any]
Source = tuple[str, Doc]  # (the JSON's name, its content)


@dataclass(frozen=True)
class Table:
    """Markdown table: the first `labels` columns read as text, the others as numbers; a note
    (the run's ceilings, say) below it."""

    header: list[str]
    rows: list[list[str]]
    labels: int = 1
    note: str = ""


@dataclass(frozen=True)
class Plot:
    """A benchmark/plot.py figure of a section's JSON: the flag that draws it, the PNG it writes."""

    flag: str
    image: str


@dataclass(frozen=True)
class Section:
    """One benchmark's part of the page; `table` builds its table from its JSON."""

    title: str
    names: tuple[str, ...]  # the JSON it renders, without .json
    prose: str
    table: Callable[[list[Source]], Table]
    plot: Plot | None = None
    folders: tuple[str, ...] = ()  # () -> the GPU folders, GPU_PREFERENCE's first


# ---- cells ---------------------------------------------------------------------------------------


def num(value: float | None, digits: int = 1) -> str:
    """`value` with thousands separators and `digits` decimals; "" for None."""
    return "" if value is None else f"{value:,.{digits}f}"


def ratio(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}x"


def rate(value: float | str) -> str:
    """A request rate: 16.0 -> "16"; "inf" as it is."""
    return value if isinstance(value, str) else f"{value:g}"


def pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def server_args(variant: str | None) -> str:
    """A run's extra server arguments (a JSON object's text) as `key=value, ...`."""
    return ", ".join(f"{k}={v}" for k, v in json.loads(variant or "{}").items())


def ordered(values: list[str], order: tuple[str, ...]) -> list[str]:
    """The distinct `values`, those in `order` first in its order, then the rest as they came."""
    distinct = list(dict.fromkeys(values))
    return sorted(distinct, key=lambda v: order.index(v) if v in order else len(order))


def step_key(step: str) -> tuple[bool, list[int]]:
    """One-batch steps' order: prefill before decode, each by its numbers (1x128, 1x512, 8x256;
    bs1, bs8, bs64)."""
    return step.startswith("decode"), [int(n) for n in re.findall(r"\d+", step)]


def rows_of(sources: list[Source], key: str = "summary") -> list[Row]:
    return [row for _, doc in sources for row in doc[key]]


# ---- bench_one_batch -----------------------------------------------------------------------------


def _column_group(row: Row) -> str:
    """The runs a one-batch row's graph columns belong to: its kernels where native, its extra
    server arguments ("" for the fused kernels and the defaults)."""
    native = "native" if row.get("kernels") == "native" else ""
    return ", ".join(filter(None, [native, server_args(row.get("variant"))]))


def _graph_cell(row: Row) -> str:
    """Graph ms waiting for each step, and back to back in parentheses where measured."""
    back = row.get("back_to_back_ms")
    return num(row["graph_ms"], 3) + (f" ({num(back, 3)})" if back is not None else "")


def modes_table(sources: list[Source]) -> Table:
    """Per model and step: eager ms, then graph ms per mode, each group of runs (kernels, extra
    server arguments) in its own columns; the floor and the first group's best mode over it."""
    rows = rows_of(sources, "rows")
    groups = list(dict.fromkeys(_column_group(r) for r in rows))
    columns = [
        (group, mode)
        for group in groups
        for mode in ["eager", *ordered([r["mode"] for r in rows], MODE_ORDER)]
        if mode == "eager" or any(_column_group(r) == group and r["mode"] == mode for r in rows)
    ]
    table = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    keys = dict.fromkeys((r["model"], r["step"]) for r in rows)
    for model, step in sorted(keys, key=lambda k: (models.index(k[0]), step_key(k[1]))):
        mine = [r for r in rows if (r["model"], r["step"]) == (model, step)]
        cells = {(_column_group(r), r["mode"]): _graph_cell(r) for r in mine}
        cells |= {(_column_group(r), "eager"): num(r["eager_ms"], 2) for r in mine}
        floor = mine[0].get("floor_ms")
        best = min(r["graph_ms"] for r in mine if _column_group(r) == groups[0])
        table.append(
            [model, step, *(cells.get(c, "") for c in columns), num(floor, 3)]
            + [ratio(best / floor if floor else None)]
        )
    header = [f"{g}: {m}" if g else m for g, m in columns]
    return Table(
        ["model", "step", *header, "floor", "best / floor"],
        table,
        labels=2,
        note=f"Copy bandwidth (the floor's): {num(sources[0][1]['copy_bandwidth_gbs'], 0)} GB/s.",
    )


def tp_table(sources: list[Source]) -> Table:
    """Per model, tensor-parallel size and extra server arguments: graph ms of every step, the
    first decode step against one GPU's and against its floor, and its all-reduce ms."""
    rows = rows_of(sources, "rows")
    steps = sorted(dict.fromkeys(r["step"] for r in rows), key=step_key)
    first_decode = next(s for s in steps if s.startswith("decode"))
    runs = dict.fromkeys((r["model"], r["tp_size"], r["variant"]) for r in rows)
    graph = {(r["model"], r["tp_size"], r["variant"], r["step"]): r for r in rows}
    one_gpu = {(r["model"], r["step"]): r["graph_ms"] for r in reversed(rows) if r["tp_size"] == 1}
    table = []
    for model, tp, variant in runs:
        step = graph[model, tp, variant, first_decode]
        base = one_gpu.get((model, first_decode))
        table.append(
            [model, str(tp), server_args(variant) or "defaults"]
            + [num(graph[model, tp, variant, s]["graph_ms"], 3) for s in steps]
            + [ratio(step["graph_ms"] / base, 3) if base else ""]
            + [ratio(step["graph_ms"] / step["floor_ms"]), num(step.get("all_reduce_ms"), 3)]
        )
    return Table(
        ["model", "TP", "server args", *steps, f"{first_decode} / TP 1"]
        + [f"{first_decode} / floor", f"all-reduce ms, {first_decode}"],
        table,
        labels=3,
    )


# ---- bench_offline -------------------------------------------------------------------------------


def _offline_run(row: Row) -> str:
    """An offline row's run: its decode mode and extra server arguments."""
    return ", ".join(filter(None, [row["decode"], server_args(row.get("server_args"))]))


def offline_table(sources: list[Source]) -> Table:
    """Per run (decode mode, extra server arguments): output tok/s with the overlap schedule and
    without, and the seconds with it."""
    rows = rows_of(sources)
    table = []
    for run in dict.fromkeys(map(_offline_run, rows)):
        by_overlap = {r["overlap"]: r for r in rows if _offline_run(r) == run}
        on, off = by_overlap.get(True, {}), by_overlap.get(False, {})
        first = on or off
        table.append(
            [run, str(first["num_seqs"]), num(first["output_tokens"], 0)]
            + [num(on.get("output_throughput"), 0), num(off.get("output_throughput"), 0)]
            + [num(on.get("seconds"), 3)]
        )
    return Table(
        ["decode, server args", "requests", "output tokens", "output tok/s, overlap on"]
        + ["overlap off", "seconds, overlap on"],
        table,
    )


# ---- bench_serving -------------------------------------------------------------------------------


def _serving_name(mode: str) -> str:
    """The JSON of scripts/gpu_check.sh's serving run of a "decode/prefill" mode."""
    return "serving_" + mode.replace("/", "_")


def _p50_p99(row: Row, metric: str, digits: int) -> str:
    return f"{num(row[f'p50_{metric}_ms'], digits)} / {num(row[f'p99_{metric}_ms'], digits)}"


def serving_table(sources: list[Source]) -> Table:
    """Per server mode, workload and cap on requests in flight: throughput, latencies, the prefix
    cache's hit rate, and for structured output the outputs that parse and the grammar's time."""
    modes = {_serving_name(m): m.replace("/", " / ") for m in SERVING_MODES}
    table = []
    for name, doc in sources:
        for r in doc["summary"]:
            valid = r.get("valid_json")
            table.append(
                [modes[name], r.get("workload", "plain"), str(r["max_concurrency"])]
                + [num(r["request_throughput"]), num(r["output_token_throughput"], 0)]
                + [_p50_p99(r, "ttft", 1), _p50_p99(r, "itl", 2), num(r["p50_tpot_ms"], 2)]
                + [pct(r.get("cache_hit_rate"))]
                + ["" if valid is None else f"{valid} / {r['completed']}"]
                + [num(r.get("grammar_host_ms_per_step"), 2)]
            )
    return Table(
        ["decode / prefill", "workload", "in flight", "req/s", "output tok/s"]
        + ["TTFT p50 / p99 ms", "ITL p50 / p99 ms", "TPOT p50 ms", "cache hit"]
        + ["outputs that parse", "grammar host ms / step"],
        table,
        labels=3,
    )


def rates_table(sources: list[Source]) -> Table:
    """Per offered request rate: requests served, throughput, latencies."""
    table = [
        [rate(r["request_rate"]), f"{r['completed']} / {r['failed']}"]
        + [num(r["request_throughput"]), num(r["output_token_throughput"], 0)]
        + [num(r["p50_ttft_ms"]), num(r["p99_itl_ms"], 2), num(r["mean_e2e_ms"], 0)]
        for r in rows_of(sources)
    ]
    return Table(
        ["req/s offered", "completed / failed", "req/s served", "output tok/s", "TTFT p50 ms"]
        + ["ITL p99 ms", "mean end-to-end ms"],
        table,
    )


# ---- bench_prefix, bench_sampling ----------------------------------------------------------------


def prefix_table(sources: list[Source]) -> Table:
    """Per workload, the cache on and off: tokens, hit rate, time, throughput, the speed-up."""
    table = [
        [r["workload"], "on" if r["cache"] else "off", str(r["requests"])]
        + [num(r["prompt_tokens"], 0), num(r["cached_tokens"], 0), pct(r["cache_hit_rate"])]
        + [num(r["seconds"], 2), num(r["output_throughput"], 0), num(r["request_throughput"])]
        + [ratio(r.get("speedup"))]
        for r in rows_of(sources)
    ]
    return Table(
        ["workload", "cache", "requests", "prompt tokens", "cached", "hit rate", "seconds"]
        + ["output tok/s", "req/s", "on / off"],
        table,
        labels=2,
    )


def sampling_table(sources: list[Source]) -> Table:
    """Per batch size: ms per step plain and penalised, and the cost of the penalties."""
    rows = rows_of(sources)
    table = []
    for bs in dict.fromkeys(r["bs"] for r in rows):
        plain, penalised = (
            next(r["step_ms"] for r in rows if (r["bs"], r["penalties"]) == (bs, p))
            for p in ("off", "on")
        )
        cost = penalised - plain
        table.append(
            [str(bs), num(plain, 3), num(penalised, 3)]
            + [f"+{num(cost, 3)} ms ({num(100 * cost / plain)}%)"]
        )
    return Table(["batch", "plain ms/step", "penalised ms/step", "cost"], table)


# ---- bench_startup -------------------------------------------------------------------------------


def _ready_s(start: Row) -> float | None:
    """When a start's HTTP process first answered /health, seconds after the spawn."""
    ends = [s["end_s"] for s in start["stages"] if s["name"] == "HTTP ready"]
    return ends[0] if ends else None


def startup_table(sources: list[Source]) -> Table:
    """Per mode: seconds to the first token, cold and warm, to a warm server's /health, and the
    in-process Engine's warm start where timed."""
    doc = sources[0][1]
    table = []
    for modes in dict.fromkeys(json.dumps(r["modes"]) for r in doc["rows"]):
        starts = {r["start"]: r for r in doc["rows"] if json.dumps(r["modes"]) == modes}
        engine = [e["seconds"] for e in doc.get("engine", []) if json.dumps(e["modes"]) == modes]
        warm = starts.get("warm")
        table.append(
            [" / ".join(json.loads(modes).values())]
            + [num(starts[s]["seconds"]) if s in starts else "" for s in ("cold", "warm")]
            + [num(_ready_s(warm)) if warm else "", num(engine[0]) if engine else ""]
        )
    return Table(
        ["decode / prefill", "cold, first token s", "warm, first token s", "warm, /health s"]
        + ["Engine, warm, first token s"],
        table,
    )


# ---- the accuracy suite --------------------------------------------------------------------------


def accuracy_table(sources: list[Source]) -> Table:
    """Per eval: eager's accuracy and interval, the cells' accuracy, their least share of
    completions identical to eager's, and how many passed."""
    rows = rows_of(sources, "rows")
    table = []
    for name in dict.fromkeys(r["eval"] for r in rows):
        cells = [r for r in rows if r["eval"] == name]
        low, high = cells[0]["reference_ci95"]
        accuracies = sorted({pct(r["accuracy"]) for r in cells})
        table.append(
            [name, str(cells[0]["num_examples"])]
            + [f"{pct(cells[0]['reference_accuracy'])} ({pct(low)}-{pct(high)})"]
            + [" / ".join(accuracies), pct(min(r["identical"] for r in cells))]
            + [f"{sum(r['passed'] for r in cells)} / {len(cells)}"]
        )
    return Table(
        ["eval", "questions", "eager accuracy (95% CI)", "the cells' accuracy"]
        + ["least identical to eager", "cells passed"],
        table,
    )


# ---- attention -----------------------------------------------------------------------------------


def backends_table(sources: list[Source]) -> Table:
    """Per phase and case: each model's kernel us per backend, and each backend's hook us."""
    rows = rows_of(sources, "rows")
    models = list(dict.fromkeys(r["model"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    table = []
    for phase, case in dict.fromkeys((r["phase"], r["case"]) for r in rows):
        by = {
            (r["model"], r["backend"]): r for r in rows if (r["phase"], r["case"]) == (phase, case)
        }
        cells = []
        for model in models:
            cells += [num(by[model, b]["us"]) for b in backends]
            cells += [" / ".join(num(by[model, b]["hook_us"], 0) for b in backends)]
        table.append([phase, case, *cells])
    header = []
    for model in models:
        header += [f"{model}: {b} us" for b in backends] + [f"hook us, {' / '.join(backends)}"]
    return Table(["phase", "case", *header], table, labels=2)


def attention_table(sources: list[Source]) -> Table:
    """Per kernel and case: us, the rate achieved and its share of the run's ceiling, and the
    torch code's us where timed (SDPA's flash kernel, index_put for the KV store)."""
    doc = sources[0][1]
    table = [
        [r["kernel"], r["case"], num(r["us"])]
        + [num(r.get("GB/s"), 0), num(r.get("pct_copy_bw"), 0)]
        + [num(r["TFLOP/s"], 0) if "pct_matmul" in r else "", num(r.get("pct_matmul"), 0)]
        + [num(r.get("sdpa_flash_us"))]
        for r in doc["rows"]
    ]
    table += [
        ["kv store", f"{k['tokens']} tokens, in a graph", num(k["fused_graph_us"])]
        + ["", "", "", "", num(k["index_put_graph_us"])]
        for k in doc["kv_store"]
    ]
    return Table(
        ["kernel", "case", "us", "GB/s", "% of copy", "TFLOP/s", "% of matmul", "torch us"],
        table,
        labels=2,
        note=f"Ceilings of the run: copy {num(doc['copy_GBps'], 0)} GB/s (bytes read + written), "
        f"bf16 matmul {num(doc['matmul_TFLOPs'], 0)} TFLOP/s.",
    )


# ---- tuning tools --------------------------------------------------------------------------------


def decode_host_table(sources: list[Source]) -> Table:
    table = [
        [num(r["bs"], 0), num(r["prepare_us"], 0), num(r["forward_us"], 0), num(r["step_ms"], 2)]
        for r in rows_of(sources)
    ]
    return Table(
        ["running requests", "prepare_decode us", "runner.forward host us", "whole step ms"], table
    )


def capture_table(sources: list[Source]) -> Table:
    """Per model, pass and phase: a capture's seconds and where they went."""
    table = [
        [r["model"], r["pass"], r["phase"], str(r["shapes"]), num(r["seconds"], 2)]
        + [f"{num(r['kernel loads'], 2)} ({r['kernels loaded']})", num(r["warm-up"], 2)]
        + [num(r["graph begin"] + r["graph end"], 2), num(r["rest"], 2)]
        for r in rows_of(sources, "rows")
    ]
    return Table(
        ["model", "pass", "phase", "shapes", "s", "kernel loads s (variants)", "warm-ups s"]
        + ["graph begin + end s", "rest s"],
        table,
        labels=3,
    )


# ---- the page ------------------------------------------------------------------------------------

SECTIONS = (
    Section(
        "One batch per mode (`bench_one_batch.py`)",
        ("one_batch",),
        "One prefill or decode step per CUDA-graph mode, decode over `--context` cached tokens a "
        "request. A mode's cell is graph ms with the GPU waiting for each step (as a server "
        "reading each step's tokens back), back to back in parentheses. *floor*: the bytes a "
        "decode step reads (weights, KV) over the copy bandwidth measured in the run.",
        modes_table,
    ),
    Section(
        "Every mode over the fused kernels and the torch code (`bench_one_batch.py --kernels`)",
        ("one_batch_native",),
        "Qwen3-0.6B's steps in every mode over the fused kernels and over the layers' torch code "
        "(*native*; tc_piecewise fused by Inductor). breakable and tc_piecewise run attention "
        "eagerly between graph segments: their decode steps are host-bound and vary between runs.",
        modes_table,
        Plot("--one-batch", "one_batch_qwen3-0.6b.png"),
    ),
    Section(
        "Tensor parallelism (`bench_one_batch.py --tp-size`)",
        ("one_batch_tp",),
        "Llama-3.1-8B per tensor-parallel size and extra server arguments, a GPU of one host per "
        "rank (NVLink multicast off); `--tp-all-reduce one-shot` sums the ranks' partials over "
        "NVLink in one kernel with the residual add and norms. *floor*: one rank's weights and "
        "KV; *all-reduce*: the collectives' median ms per step under torch.profiler.",
        tp_table,
    ),
    Section(
        "Tensor parallelism, Llama-3.1-70B",
        ("one_batch_70b",),
        "Llama-3.1-70B's shape at the tensor-parallel sizes a host holds, columns as above.",
        tp_table,
    ),
    Section(
        "Offline throughput (`bench_offline.py`)",
        ("offline",),
        "The in-process Engine on nano-vllm's workload (random token ids, prompt and output "
        "lengths uniform in `--min-len`..`--max-len`, temperature 0.6, EOS ignored), dummy "
        "Qwen3-0.6B, per decode mode. The overlap schedule launches each decode step before "
        "reading the last one back.",
        offline_table,
    ),
    Section(
        "Offline, one request",
        ("offline_bs1",),
        "The same Engine on one request, full decode graphs: a server's step for one client.",
        offline_table,
    ),
    Section(
        "Offline with tensor parallelism",
        ("offline_tp",),
        "nano-vllm's workload on Llama-3.1-8B, full decode graphs, on one GPU and on `tp_size`.",
        offline_table,
    ),
    Section(
        "Serving per mode (`bench_serving.py`)",
        tuple(_serving_name(m) for m in SERVING_MODES),
        "One server per decode / prefill mode, the built-in SmolLM2-135M-Instruct, all requests "
        "sent at once, at most *in flight* running, greedy, streamed. *json_schema*: prompts "
        "asking for a JSON record under one `response_format` schema (the output budget cuts the "
        "outputs that do not parse). Runs after a workload's first find its prompts cached.",
        serving_table,
        Plot("--serving", "serving.png"),
    ),
    Section(
        "Serving at fixed request rates (`bench_serving.py --request-rate`)",
        ("serving_rates_defaults",),
        "The built-in SmolLM2-135M-Instruct server, its defaults, Poisson arrivals at each rate "
        "for `--rate-seconds` (`inf`: all at once), lognormal lengths, greedy, EOS ignored, "
        "streamed. A finite rate's output tok/s is its tokens over the run's duration; the "
        "capacity shows at `inf`.",
        rates_table,
        Plot("--serving-rates", "serving_rates.png"),
    ),
    Section(
        "Prefix cache (`bench_prefix.py`)",
        ("prefix",),
        "The prefix cache through the in-process Engine, dummy Qwen3-0.6B, each workload on a "
        "fresh Engine with the cache on and off (`--disable-radix-cache`). *shared_prefix*: "
        "requests sharing one long prefix; *multi_turn*: each turn's prompt is the last prompt, "
        "its answer and a new message. *cached*: the prompt tokens reported cached.",
        prefix_table,
    ),
    Section(
        "Sampling adjustments (`bench_sampling.py`)",
        ("sampling",),
        "Decode ms per step through the scheduler (overlap schedule, full decode graphs, dummy "
        "Qwen3-0.6B), plain requests against requests with presence, frequency and repetition "
        "penalties and a `logit_bias` entry.",
        sampling_table,
    ),
    Section(
        "Start-up (`bench_startup.py`)",
        ("startup",),
        "Seconds from spawning `launch_server` to the first token of `POST /generate`: *cold* "
        "with empty compile, Triton and tokenizer caches, *warm* on those the cold start filled; "
        "each start reads a bytecode cache filled before the first. The JSON's `rows` hold every "
        "stage's seconds.",
        startup_table,
    ),
    Section(
        "Start-up on the CPU",
        ("startup",),
        "The same on the CPU with the built-in SmolLM2 GGUF (float32, eager), and the Engine.",
        startup_table,
        folders=(CPU,),
    ),
    Section(
        "Accuracy per mode (`test/accuracy/test_mode_accuracy.py`)",
        ("accuracy",),
        "gsm8k and mgsm_en asked of one server per decode x prefill cell accepted on CUDA and of "
        "an eager one, SmolLM2-135M-Instruct, `--deterministic`, greedy. A cell passes when its "
        "accuracy lies in eager's 95% interval and enough completions (the JSON's "
        "`min_identical`) equal eager's.",
        accuracy_table,
    ),
    Section(
        "Attention backends (`bench_attention_backends.py`)",
        ("attention_backends",),
        "One attention layer through each backend's interface, bf16, random KV slots: decode "
        "replayed from a CUDA graph, prefill eagerly (as breakable graphs run it). *hook*: the "
        "backend's per-step work before its kernels (replay hook, `init_forward_metadata`).",
        backends_table,
    ),
    Section(
        "Attention kernels (`bench_attention.py`)",
        ("attention",),
        "The Triton attention kernels alone with Qwen3-0.6B's heads, bf16, against ceilings "
        "measured in the run (the copy rate counts bytes read and written, so pure reads can pass "
        "it). Decode: the model's launch, graphed; *mixed*: lengths uniform in 100-2048, in "
        "request order or longest first.",
        attention_table,
    ),
    Section(
        "Host time per decode step at scale (`tuning/bench_decode_host.py`)",
        ("decode_host_scale",),
        "The host side of a server's decode step with hundreds of running requests (dummy "
        "Qwen3-0.6B): `prepare_decode` builds the batch, `runner.forward` launches the graph; the "
        "whole step includes the GPU's work.",
        decode_host_table,
    ),
    Section(
        "CUDA-graph capture (`tuning/bench_capture.py`)",
        ("capture",),
        "A capture's seconds per phase, warm Triton cache: *start* in a fresh process, *again* "
        "repeated in it, *no empty_cache* with `torch.cuda.empty_cache` a no-op; *rest*: the "
        "captured forwards.",
        capture_table,
    ),
)

INTRO = """# Benchmarks

<!-- Generated by benchmark/render_docs.py from benchmark/results/: edit those, not this page. -->

The current result of each benchmark, rendered from its JSON under `benchmark/results/<gpu>/`
(where several GPUs' folders hold one, the first of the renderer's `GPU_PREFERENCE`; the history
is in git). Each section gives the command, GPU, versions, commit and date its JSON records. The
scripts are described in [benchmark/README.md](../benchmark/README.md), the kernel choices behind
these numbers in [tuning.md](tuning.md). Hosts of one GPU kind differ by a few percent: compare
within a table. Models given by name are the configs in `benchmark/configs/` with random bf16
weights; step times are CUDA-event medians after warm-up.
"""


def gpu_folders(results: Path) -> tuple[str, ...]:
    """The GPU folders under `results`, GPU_PREFERENCE's first, then the others by name."""
    names = [p.name for p in results.iterdir() if p.is_dir() and p.name != CPU]
    rank = {name: i for i, name in enumerate(GPU_PREFERENCE)}
    return tuple(sorted(names, key=lambda name: (rank.get(name, len(rank)), name)))


def section_files(section: Section, results: Path) -> list[Path]:
    """The section's JSON in the first of its folders that holds any ([] where none does)."""
    for folder in section.folders or gpu_folders(results):
        found = [results / folder / f"{name}.json" for name in section.names]
        if any(path.is_file() for path in found):
            return [path for path in found if path.is_file()]
    return []


def load(path: Path) -> Doc:
    """The JSON at `path`; SystemExit where its environment's device is another folder's."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    gpu = doc.get("environment", {}).get("gpu")
    if gpu_slug(gpu) != path.parent.name:
        raise SystemExit(
            f"{path}: measured on {gpu or 'the CPU'}, so it belongs in {gpu_slug(gpu)}/"
        )
    return doc


def provenance(path: Path, doc: Doc) -> list[str]:
    """Two list items: the command, then device, versions, commit, date and a link to the JSON."""
    env = doc.get("environment", {})
    cuda = f" (CUDA {env['cuda']})" if env.get("cuda") else ""
    versions = [f"torch {env.get('torch')}{cuda}", f"triton {env.get('triton')}"]
    versions += [f"driver {env['driver']}"] if env.get("driver") else []
    commit = f"commit `{env['commit']}`" if env.get("commit") else "commit not recorded"
    link = Path(os.path.relpath(path, PAGE.parent)).as_posix()
    return [
        f"- `{env.get('command') or 'command not recorded'}`",
        f"- {env.get('gpu') or 'CPU'}, {', '.join(versions)}; {commit}, "
        f"{env.get('date') or 'date not recorded'}: [{path.name}]({link})",
    ]


def markdown_table(table: Table) -> list[str]:
    """The table's lines, leaving out the columns that no row fills."""
    keep = [i for i in range(len(table.header)) if any(row[i] for row in table.rows)]
    align = ["---" if i < table.labels else "---:" for i in keep]
    lines = [
        [table.header[i] for i in keep],
        align,
        *([row[i] for i in keep] for row in table.rows),
    ]
    out = ["| " + " | ".join(cells) + " |" for cells in lines]
    return out + ([f"\n{table.note}"] if table.note else [])


def render_section(section: Section, paths: list[Path]) -> list[str]:
    sources = [(path.stem, load(path)) for path in paths]
    lines = [f"## {section.title}", "", textwrap.fill(section.prose, 100), ""]
    for path, (_, doc) in zip(paths, sources, strict=True):
        lines += provenance(path, doc)
    lines += ["", *markdown_table(section.table(sources)), ""]
    if section.plot and (IMAGES / section.plot.image).is_file():
        lines += [f"![{section.title.replace('`', '')}](img/{section.plot.image})", ""]
    return lines


def render(results: Path = RESULTS) -> str:
    """The page: INTRO, then every section whose JSON `results` holds, in SECTIONS' order."""
    lines = [INTRO]
    for section in SECTIONS:
        paths = section_files(section, results)
        if paths:
            lines += render_section(section, paths)
    return "\n".join(lines).rstrip("\n") + "\n"


def unrendered(results: Path) -> list[Path]:
    """The JSON under `results` that no section shows (another GPU's beside the one shown, or a
    benchmark without a section)."""
    shown = {path for section in SECTIONS for path in section_files(section, results)}
    return sorted(set(results.glob("*/*.json")) - shown)


def draw_plots(results: Path) -> None:
    """Redraw every section's plot from the JSON the page shows, with benchmark/plot.py."""
    for section in SECTIONS:
        paths = section_files(section, results)
        if section.plot and paths:
            cmd = [sys.executable, str(REPO / "benchmark" / "plot.py"), section.plot.flag]
            subprocess.run([*cmd, *map(str, paths), "--out", str(IMAGES)], check=True)


def check(page: str) -> int:
    """0 when the committed page is `page`; else 1, with the difference on stderr."""
    committed = PAGE.read_text(encoding="utf-8") if PAGE.is_file() else ""
    if committed == page:
        return 0
    diff = difflib.unified_diff(
        committed.splitlines(), page.splitlines(), "committed", "rendered", lineterm="", n=0
    )
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    print(
        f"{os.path.relpath(PAGE, REPO)} differs from its render of benchmark/results: "
        "run python benchmark/render_docs.py",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--plots", action="store_true", help="redraw the plots first")
    args = parser.parse_args(argv)
    if args.plots:
        draw_plots(RESULTS)
    for path in unrendered(RESULTS):
        print(f"not on the page: {path.relative_to(REPO)}", file=sys.stderr)
    page = render()
    if args.check:
        return check(page)
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
