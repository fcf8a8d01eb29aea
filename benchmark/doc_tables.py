"""The tables of docs/benchmarks.md: one builder per benchmark, each turning the rows of its JSON
(`Source`: its name and content) into a `Table`, cells formatted here (render_docs.py lays out the
page)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

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


# ---- cells ---------------------------------------------------------------------------------------


def num(value: float | None, digits: int = 1) -> str:
    """`value` with thousands separators and `digits` decimals; "" for None."""
    return "" if value is None else f"{value:,.{digits}f}"


def ratio(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}x"


def rate(value: float | str) -> str:
    """A request rate: 16.0 -> "16"; "inf" as it is."""
    return value if isinstance(value, str) else f"{value:g}"


def workload(row: Row) -> str:
    """A serving row's workload, "" for the plain one."""
    return "" if row.get("workload", "plain") == "plain" else row["workload"]


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


# ---- bench_speculative ---------------------------------------------------------------------------


SPECULATIVE_DRAFTERS = {"ngram": "ngram", "draft_model": "draft model"}


def speculative_table(sources: list[Source]) -> Table:
    """Per drafter run (model, drafter, drafts per verify, what was timed), one column per batch
    size: the speed-up over plain and tokens per verify step; whether every output equalled
    plain decoding's; the verify and draft steps' costs against a decode step in the note."""
    rows = rows_of(sources)
    runs: dict[tuple[str, str, int, str], dict[int, Row]] = {}
    for r in rows:
        if r["part"] in ("step", "draft_step"):
            continue
        drafter = SPECULATIVE_DRAFTERS.get(r["part"]) or f"replay, {pct(r['corrupt'])} corrupted"
        key = (r["model"], drafter, r["steps"], r.get("timed", "run"))
        runs.setdefault(key, {})[r["bs"]] = r
    sizes = sorted({bs for by_bs in runs.values() for bs in by_bs})
    table = []
    for (model, drafter, drafts, timed), by_bs in runs.items():
        cells = [
            f"{ratio(by_bs[bs]['speedup'])} ({num(by_bs[bs]['tokens_per_verify'], 2)})"
            if bs in by_bs
            else ""
            for bs in sizes
        ]
        differ = [str(bs) for bs, r in by_bs.items() if not r["identical"]]
        equal = "yes" if not differ else f"not at bs {', '.join(differ)}"
        table.append([model, drafter, str(drafts), timed, *cells, equal])
    steps: dict[tuple[str, int], list[str]] = {}
    for r in rows:
        if r["part"] == "step" and r["tokens_per_request"] > 1:
            key = (r["model"], r["bs"])
            steps.setdefault(key, []).append(f"{r['tokens_per_request']}: {ratio(r['vs_decode'])}")
    notes = []
    if steps:
        notes.append(
            "Verify step / decode step, by tokens per request: "
            + "; ".join(
                f"{model} bs {bs}: {', '.join(parts)}" for (model, bs), parts in steps.items()
            )
            + "."
        )
    drafters: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r["part"] == "draft_step":
            drafters.setdefault((r["model"], r["target"]), []).append(r)
    for (draft, target), drafts in drafters.items():
        notes.append(
            f"Draft step / target decode step ({draft} for {target}): "
            + ", ".join(f"bs {r['bs']} {ratio(r['vs_target_decode'])}" for r in drafts)
            + "."
        )
    return Table(
        ["model", "drafter", "drafts", "timed", *(f"bs {bs}" for bs in sizes), "equals plain"],
        table,
        labels=2,
        note=" ".join(notes),
    )


# ---- bench_serving -------------------------------------------------------------------------------


def serving_name(mode: str) -> str:
    """The JSON of scripts/gpu_check.sh's serving run of a "decode/prefill" mode."""
    return "serving_" + mode.replace("/", "_")


def _p50_p99(row: Row, metric: str, digits: int) -> str:
    return f"{num(row[f'p50_{metric}_ms'], digits)} / {num(row[f'p99_{metric}_ms'], digits)}"


def serving_table(sources: list[Source]) -> Table:
    """Per server mode, workload and cap on requests in flight: throughput, latencies, the prefix
    cache's hit rate, and for structured output the outputs that parse and the grammar's time."""
    modes = {serving_name(m): m.replace("/", " / ") for m in SERVING_MODES}
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
    """Per offered request rate (and workload, where not plain): requests served, throughput,
    latencies."""
    table = [
        [", ".join(filter(None, [workload(r), rate(r["request_rate"])]))]
        + [f"{r['completed']} / {r['failed']}"]
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


# ---- bench_http ----------------------------------------------------------------------------------


def http_table(sources: list[Source]) -> Table:
    """Per model: the in-process Engine, then the server per front-end count."""
    table = []
    for row in rows_of(sources, "rows"):
        if row["setting"] == "engine":
            table.append([row["model"], "Engine", num(row["output_tok_s"], 0), "", ""])
            table[-1] += [num(row["mean_step_ms"]), "", ""]
            continue
        count = row["api_server_count"]
        table.append(
            [row["model"], f"HTTP, {count} front end{'s' if count > 1 else ''}"]
            + [num(row["output_tok_s"], 0), ratio(row.get("vs_engine"))]
            + [num(row["p50_ttft_ms"] / 1e3, 2), num(row["p50_itl_ms"]), num(row["p99_itl_ms"])]
            + [num(row["front_end_cpu_us_per_token"])]
        )
    return Table(
        ["model", "run", "output tok/s", "of the Engine", "TTFT p50 s"]
        + ["ITL p50 ms (Engine: mean step)", "ITL p99 ms", "front-end CPU us/token"],
        table,
        labels=2,
    )


# ---- bench_moe_kernel ----------------------------------------------------------------------------


def moe_kernel_table(sources: list[Source]) -> Table:
    """Per model and token count: the experts reached, the route the layer takes, its and the
    sorted route's microseconds, cuBLAS-per-expert's and torch's grouped GEMM's, the weight-read
    floor and the ratios."""
    rows = rows_of(sources, "rows")
    table = [
        [r["model"], str(r["tokens"]), r["route"], str(r["experts_reached"])]
        + [num(r["fused_us"], 1), num(r["sorted_us"], 1), num(r["cublas_us"], 1)]
        + [num(r["grouped_mm_us"], 1), num(r["floor_us"], 1)]
        + [ratio(r["fused_over_floor"]), ratio(r["cublas_over_fused"], 1)]
        for r in rows
    ]
    configs = sorted({r["block_configs"] for r in rows})
    return Table(
        ["model", "tokens", "route", "experts reached", "fused us", "sorted route us"]
        + ["cuBLAS per expert us", "torch grouped_mm us"]
        + ["floor us", "fused / floor", "cuBLAS / fused"],
        table,
        labels=3,
        note=f"Block configs: {'; '.join(configs)}.",
    )


# ---- bench_fp8_gemm ------------------------------------------------------------------------------

FP8_GEMM_VARIANTS = ("bf16", "channel", "channel_gemm", "block", "block_gemm")


def fp8_gemm_table(sources: list[Source]) -> Table:
    """Per projection and row count: microseconds of bf16 cuBLAS and of each FP8 variant, the
    bf16 and best FP8 TFLOP/s, and bf16's time over the faster FP8 path's (quantization in)."""
    table = []
    for r in rows_of(sources, "rows"):
        us, tflops = r["us"], r["tflops"]
        best = min(us["channel"], us["block"])
        table.append(
            [r["model"], r["proj"], f"{r['n']} x {r['k']}", str(r["rows"])]
            + [num(us[v], 1) for v in FP8_GEMM_VARIANTS]
            + [num(tflops["bf16"], 0), num(max(tflops[v] for v in FP8_GEMM_VARIANTS[1:]), 0)]
            + [ratio(us["bf16"] / best)]
        )
    return Table(
        ["model", "projection", "N x K", "rows", "bf16 us", "channel us", "channel GEMM us"]
        + ["block us", "block GEMM us", "bf16 TFLOP/s", "best FP8 TFLOP/s", "bf16 / FP8"],
        table,
        labels=4,
        note="channel: per-token quantization kernel + torch._scaled_mm (row-wise scales); "
        "block: per-token-group quantization + the 128 x 128 block-scaled Triton GEMM; the GEMM "
        "columns leave the quantization out. bf16 / FP8: against the faster of channel and block.",
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
