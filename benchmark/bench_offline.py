"""Offline throughput through the in-process Engine, one row per CUDA-graph mode.

    python benchmark/bench_offline.py [--model-path benchmark/configs/qwen3-0.6b.json]
        [--num-seqs 256] [--min-len 100] [--max-len 1024] [--output-len N] [--seed 0]
        [--device auto]
        [--modes full breakable tc_piecewise disabled '{"decode": "full", "prefill": "disabled"}']
        [--overlap on off] [--disable-radix-cache] [--server-args JSON ...] [--json out.json]

The workload of nano-vllm's bench.py, so the numbers sit beside theirs (Qwen3-0.6B on an RTX
4070 Laptop: nano-vllm 1,434 tok/s, vLLM 1,362 tok/s): `--num-seqs` prompts of random token ids
(uniform in [0, 10000]), each prompt's length and its output length uniform in [--min-len,
--max-len] (`--output-len N`: N tokens each; 1 times a prefill, as `--num-seqs 64 --min-len 512
--max-len 512 --output-len 1` does for 64 x 512 prompt tokens), sampled at temperature 0.6 with
`ignore_eos`, so every request generates exactly its output length. A mode is a `--cuda-graph-
mode` JSON object or a decode-mode name (the prefill phase then keeps its default). Per mode: a
fresh Engine (random weights of the config's shapes with `--load-format dummy`), one untimed
warm-up generation (the first 8 prompts whole, 16 tokens each: Triton's JIT is not timed), then
the whole batch in one `generate` call, timed by the wall clock (CUDA synchronised). Throughput
is generated tokens per second. `--overlap on off` runs every mode with the overlap schedule and
without it (`--disable-overlap-schedule`). `--server-args` takes one or more JSON objects of
further Engine (ServerArgs) fields, e.g. `'{}' '{"max_running_requests": 512}'`: every mode runs
with each. Prints a markdown table; `--json` writes `{"config", "summary": [one row per mode,
overlap setting and server-args object]}`. `--profile` (CUDA) runs the workload once more under
torch.profiler and adds where its GPU time went: wall seconds, seconds some kernel ran ("busy"),
and the kernels' seconds per category (matmul, decode and prefill attention, norms, ...; by
kernel name, `KERNEL_CATEGORIES` in common.py) as the row's `gpu_seconds` and a second table."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replaylm.entrypoints.engine import Engine
from replaylm.model_executor.cuda_graph.config import MODES
from replaylm.model_executor.forward_stats import ForwardStats

from common import KERNEL_CATEGORIES, config_path, gpu_seconds, release_memory, write_json

QWEN3_CONFIG = config_path("qwen3-0.6b")
DEFAULT_MODES = ("full", "breakable", "tc_piecewise", "disabled")  # every decode mode on CUDA
TEMPERATURE = 0.6  # nano-vllm's
MAX_TOKEN_ID = 10000  # prompts draw ids from [0, min(this, vocab - 1)]
# the warm-up prefills the first prompts whole (chunked like the timed run's), so Triton's JIT of
# the prefill kernels is not timed: on a cold cache it cost the first mode ~1 s of a 1 s run
WARMUP_SEQS, WARMUP_TOKENS = 8, 16


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and each one's output length."""

    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(
    num_seqs: int,
    min_len: int,
    max_len: int,
    seed: int,
    vocab_size: int,
    output_len: int | None = None,
) -> Workload:
    """nano-vllm's random workload; the same for every mode (it depends only on the arguments).
    `output_len`: every request's output length instead of a draw like its prompt's."""
    rng = random.Random(seed)
    high = min(MAX_TOKEN_ID, vocab_size - 1)
    prompts = [
        [rng.randint(0, high) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_seqs)
    ]
    drawn = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return Workload(prompts, drawn if output_len is None else [output_len] * num_seqs)


def cuda_graph_mode(mode: str) -> str:
    """The `--cuda-graph-mode` JSON of a mode argument: a decode-mode name, or JSON as given."""
    return json.dumps({"decode": mode}) if mode in MODES else mode


def build_engine(
    args: argparse.Namespace, mode: str, overlap: bool = True, extra: str = "{}"
) -> Engine:
    """An Engine whose context holds the longest prompt plus the longest output; `extra`: further
    ServerArgs fields as a JSON object."""
    return Engine(
        model_path=str(args.model_path),
        load_format=args.load_format,
        device=args.device,
        seed=args.seed,
        context_length=2 * args.max_len,
        cuda_graph_mode=cuda_graph_mode(mode),
        disable_overlap_schedule=not overlap,
        disable_radix_cache=args.disable_radix_cache,
        **json.loads(extra),
    )


def _sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def _params(output_len: int) -> dict[str, Any]:
    return {"max_new_tokens": output_len, "temperature": TEMPERATURE, "ignore_eos": True}


def run_mode(
    engine: Engine, mode: str, workload: Workload, extra: str = "{}", profiled: bool = False
) -> dict[str, Any]:
    """Warm up, then time the whole workload in one generate call; one summary row. `profiled`:
    then run it once more under the profiler, for the row's `gpu_seconds`."""
    engine.generate(
        input_ids=workload.prompts[:WARMUP_SEQS], sampling_params=_params(WARMUP_TOKENS)
    )
    engine.flush_cache()  # the timed prompts find none of the warm-up's cached
    engine.runner.forward_stats = ForwardStats()  # count the timed run's forwards only
    params = [_params(n) for n in workload.output_lens]
    _sync(engine)
    start = time.perf_counter()
    outputs = engine.generate(input_ids=workload.prompts, sampling_params=params)
    _sync(engine)
    seconds = time.perf_counter() - start
    row = result_row(
        mode,
        engine.runner.cuda_graphs.summary(),
        len(workload.prompts),
        input_tokens=sum(len(p) for p in workload.prompts),
        output_tokens=sum(len(o["output_ids"]) for o in outputs),
        requested_output_tokens=sum(workload.output_lens),
        seconds=seconds,
        forwards=dataclasses.asdict(engine.runner.forward_stats)["phases"],
        overlap=engine.scheduler.overlap,
        server_args=extra,
    )
    if profiled:
        engine.flush_cache()
        times = gpu_seconds(
            lambda: engine.generate(input_ids=workload.prompts, sampling_params=params)
        )
        row["gpu_seconds"] = {k: round(v, 3) for k, v in times.items()}
    return row


def result_row(
    mode: str,
    resolved: str,
    num_seqs: int,
    input_tokens: int,
    output_tokens: int,
    requested_output_tokens: int,
    seconds: float,
    forwards: dict[str, dict[str, int]],
    overlap: bool = True,
    server_args: str = "{}",
) -> dict[str, Any]:
    """One mode's summary row. `resolved` is the engine's per-phase config as JSON; `forwards`
    counts the timed run's graph / eager forward passes per phase; `overlap`: whether the
    scheduler overlapped decode steps; `server_args`: the further ServerArgs fields (JSON)."""
    phases = json.loads(resolved)
    extra = "" if json.loads(server_args) == {} else f" {server_args}"
    return {
        "name": f"offline {mode}" + ("" if overlap else " no-overlap") + extra,
        "mode": mode,
        "decode": phases["decode"],
        "overlap": overlap,
        "prefill": phases["prefill"],
        "server_args": server_args,
        "num_seqs": num_seqs,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": requested_output_tokens,
        "seconds": round(seconds, 3),
        "output_throughput": round(output_tokens / seconds, 2),
        "total_throughput": round((input_tokens + output_tokens) / seconds, 2),
        "forwards": forwards,
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per mode; "graph decode steps" counts those replayed from a CUDA graph."""
    lines = [
        "| decode | prefill | overlap | server args | seqs | output tokens | seconds "
        "| output tok/s | total tok/s | graph decode steps |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        decode = r["forwards"]["decode"]
        overlap = "on" if r.get("overlap", True) else "off"
        lines.append(
            f"| {r['decode']} | {r['prefill']} | {overlap} | {r.get('server_args', '{}')} | "
            f"{r['num_seqs']} | "
            f"{r['output_tokens']} | "
            f"{r['seconds']:.2f} | {r['output_throughput']:.0f} | {r['total_throughput']:.0f} | "
            f"{decode['graph']}/{decode['graph'] + decode['eager']} |"
        )
    return "\n".join(lines)


def gpu_table(rows: list[dict[str, Any]]) -> str:
    """The profiled runs' GPU seconds: wall, busy (some kernel running), then per category."""
    columns = ["wall", "busy", *(name for name, _ in KERNEL_CATEGORIES), "other"]
    lines = [
        "| run | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for r in rows:
        times = r["gpu_seconds"]
        cells = " | ".join(f"{times.get(c, 0.0):.3f}" for c in columns)
        lines.append(f"| {r['name']} | {cells} |")
    return "\n".join(lines)


def bench_mode(
    args: argparse.Namespace, mode: str, overlap: bool = True, extra: str = "{}"
) -> dict[str, Any]:
    """Build the mode's Engine, run the workload; the Engine is garbage once this returns."""
    engine = build_engine(args, mode, overlap, extra)
    workload = make_workload(
        args.num_seqs,
        args.min_len,
        args.max_len,
        args.seed,
        engine.runner.config.vocab_size,
        args.output_len,
    )
    return run_mode(engine, mode, workload, extra, args.profile)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", type=Path, default=QWEN3_CONFIG)
    parser.add_argument("--load-format", default="dummy", help="default: %(default)s")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument(
        "--min-len", type=int, default=100, help="shortest prompt and output (tokens)"
    )
    parser.add_argument(
        "--max-len", type=int, default=1024, help="longest prompt and output (tokens)"
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="every request's output tokens (default: uniform in --min-len..--max-len); "
        "1 times a prefill",
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's and the weights'")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        help="decode-mode names or --cuda-graph-mode JSON objects",
    )
    parser.add_argument(
        "--overlap",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="the scheduler's overlap schedule; several: every mode with each",
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="prefix cache off (the workload's random prompts share no prefix: it costs only "
        "its bookkeeping)",
    )
    parser.add_argument(
        "--server-args",
        nargs="+",
        default=["{}"],
        help="further Engine (ServerArgs) fields, JSON objects; several: every mode with each",
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: run the workload once more under the profiler; GPU seconds per kernel "
        "category in the table and the JSON",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for extra in args.server_args:
        try:
            if not isinstance(json.loads(extra), dict):
                raise ValueError
        except ValueError:
            parser.error(f"--server-args: expected a JSON object, got {extra!r}")
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.num_seqs < 1:
        parser.error("--num-seqs must be at least 1")
    if args.output_len is not None and args.output_len < 1:
        parser.error("--output-len must be at least 1")
    if args.profile and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--profile times CUDA kernels: it needs a GPU")
    return args


def write_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    config = {
        **vars(args),
        "model_path": str(args.model_path),
        "json": str(args.json),
        "temperature": TEMPERATURE,
    }
    write_json(args.json, {"config": config, "summary": rows})


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every mode; returns the summary rows (also printed, and written with --json after
    each mode, so a mode that fails leaves the earlier ones' rows)."""
    args = parse_args(argv)
    rows = []
    for mode, overlap, extra in itertools.product(args.modes, args.overlap, args.server_args):
        rows.append(bench_mode(args, mode, overlap == "on", extra))
        label = f"{mode} (overlap {overlap}) {extra}"
        print(f"{label}: {rows[-1]['output_throughput']:.0f} output tok/s", flush=True)
        if rows[-1]["output_tokens"] != rows[-1]["requested_output_tokens"]:
            print(
                f"warning: {label} generated {rows[-1]['output_tokens']} tokens, "
                f"{rows[-1]['requested_output_tokens']} were requested"
            )
        if args.json:
            write_rows(args, rows)
        release_memory()
    print(f"\n{markdown_table(rows)}")
    if args.profile:
        print(f"\n{gpu_table(rows)}")
    return rows


if __name__ == "__main__":
    main()
