"""The prefix cache through the in-process Engine: a shared-prefix and a multi-turn workload with
the cache on and off, and optionally the gsm8k eval's wall time through a server.

    python benchmark/bench_prefix.py [--model-path benchmark/configs/qwen3-0.6b.json]
        [--workloads shared_prefix multi_turn] [--cache on off] [--output-len 64]
        [--num-requests 512] [--prefix-len 2000] [--suffix-len 48]
        [--conversations 64] [--turns 4] [--user-len 256]
        [--server-args JSON] [--seed 0] [--device auto] [--json out.json]
        [--decode-bs 1 8 64 [--decode-context 512] [--decode-steps 100]]
        [--gsm8k [--gsm8k-model smollm2-135m-instruct] [--gsm8k-examples 200]
                 [--gsm8k-parallel 128] [--gsm8k-server-args ARGS]]

Prompts are random token ids (uniform in [0, min(10000, vocab - 1)], from `--seed`), sampled
greedily with `ignore_eos`, so every request generates exactly `--output-len` tokens:

- `shared_prefix`: `--num-requests` prompts, one `--prefix-len`-token prefix shared by all and
  `--suffix-len` tokens of each one's own, submitted in one `generate` call.
- `multi_turn`: `--conversations` conversations of `--turns` turns. Turn 0's prompt is a
  `--user-len`-token user message; turn t's prompt is turn t-1's prompt, the ids generated for it
  and a new user message. A turn's prompts are submitted in one `generate` call once the previous
  turn has finished.

Each workload runs once per `--cache` setting (`off`: `--disable-radix-cache`), each on a fresh
Engine (the config's shapes with seeded `--load-format dummy` weights: the same in every run),
after an untimed warm-up: the same workload at a small scale on other random ids, so Triton's JIT
is not timed and the timed prompts find nothing of theirs cached. A run's time is the wall clock
from its first `generate` call to the return of its last. Per run: requests, prompt tokens, cached
tokens (the outputs' `meta_info["cached_tokens"]` summed, 0 where the Engine reports none), the
hit rate (cached / prompt tokens), seconds, output tok/s and req/s; with both settings, the
speed-up (off's seconds over on's, on the `on` row) and the fraction of requests whose generated
ids are the same under both (`identical`).

`--decode-bs` also times decode steps through the scheduler with the cache on and off (the cache
must cost a decode step nothing): per batch size, that many requests of `--decode-context` random
prompt tokens decoding greedily, `--decode-steps` steps timed after a warm-up (common.py's
`scheduler_decode_ms`), on one runner of the model with the default modes. Its rows: batch size,
ms per step, and on the `on` row its excess over `off`.

`--gsm8k` also times the gsm8k eval (5-shot, greedy, at most 512 tokens per answer; the five
shots open every prompt) once per `--cache` setting, each through `python -m
replaylm.eval.run_eval` against its own `launch_server` (`--device`, `--gsm8k-server-args`).
The eval sends text, so that server's model needs a tokenizer: by default the built-in
SmolLM2-135M-Instruct, real weights whose answers are graded. Dummy weights of a config work with
a tokenizer (`--gsm8k-model benchmark/configs/qwen3-0.6b.json --gsm8k-server-args
"--load-format dummy --tokenizer-path DIR"`); their answers are meaningless and mostly run to the
token limit, but the wall time still compares the cache on and off. Its rows: questions, accuracy,
seconds, output tok/s, req/s, speed-up and the fraction of identical answers.

Prints markdown tables; `--json` writes `{"config", "summary": [one row per workload and cache
setting]}`.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replaylm.entrypoints.engine import Engine
from replaylm.eval import run_eval
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from common import (
    SCHEDULER_WARMUP_STEPS,
    bench_scheduler,
    build_runner,
    config_path,
    launched_server,
    next_turn_prompts,
    release_memory,
    scheduler_decode_ms,
    shared_prefix_prompts,
    write_json,
)

WORKLOADS = ("shared_prefix", "multi_turn")
MAX_TOKEN_ID = 10000  # prompts draw ids from [0, min(this, vocab - 1)]
# the warm-up's scale: enough requests to batch and, for multi_turn, a second turn that hits
WARMUP_REQUESTS, WARMUP_TURNS, WARMUP_TOKENS = 8, 2, 16
GSM8K_SHOTS, GSM8K_MAX_TOKENS = 5, 512


@dataclass
class Run:
    """What one workload generated under one cache setting: per request (in submission order,
    turn by turn) its prompt length, its cached tokens and the ids it generated."""

    workload: str
    cache: bool
    prompt_lens: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    output_ids: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0

    def generate(
        self, engine: Engine, prompts: list[list[int]], output_len: int
    ) -> list[list[int]]:
        """Generate for `prompts` in one call, record them; the generated ids."""
        params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        answers = [o["output_ids"] for o in outputs]
        self.prompt_lens += [len(p) for p in prompts]
        self.cached += [o["meta_info"].get("cached_tokens", 0) for o in outputs]
        self.output_ids += answers
        return answers


def shared_prefix(
    engine: Engine, draw: Callable[[int], list[int]], args: argparse.Namespace, run: Run
) -> None:
    """Every prompt at once, each the shared prefix and its own suffix; recorded in `run`."""
    prompts = shared_prefix_prompts(draw, args.num_requests, args.prefix_len, args.suffix_len)
    start = time.perf_counter()
    run.generate(engine, prompts, args.output_len)
    run.seconds = time.perf_counter() - start


def multi_turn(
    engine: Engine, draw: Callable[[int], list[int]], args: argparse.Namespace, run: Run
) -> None:
    """The conversations turn by turn, each turn's prompts in one call; recorded in `run`."""
    # every user message is drawn before the clock starts
    messages = [[draw(args.user_len) for _ in range(args.conversations)] for _ in range(args.turns)]
    prompts = messages[0]
    start = time.perf_counter()
    answers = run.generate(engine, prompts, args.output_len)
    for turn in messages[1:]:
        prompts = next_turn_prompts(prompts, answers, turn)
        answers = run.generate(engine, prompts, args.output_len)
    run.seconds = time.perf_counter() - start


RUNNERS = {"shared_prefix": shared_prefix, "multi_turn": multi_turn}


def longest_sequence(args: argparse.Namespace, workload: str) -> int:
    """Prompt plus output of the workload's longest request."""
    if workload == "shared_prefix":
        return args.prefix_len + args.suffix_len + args.output_len
    return args.turns * (args.user_len + args.output_len)


def warmup_args(args: argparse.Namespace) -> argparse.Namespace:
    """The warm-up's sizes: the workload's lengths, fewer requests, turns and output tokens."""
    return argparse.Namespace(
        **{
            **vars(args),
            "num_requests": min(WARMUP_REQUESTS, args.num_requests),
            "conversations": min(WARMUP_REQUESTS, args.conversations),
            "turns": min(WARMUP_TURNS, args.turns),
            "output_len": min(WARMUP_TOKENS, args.output_len),
        }
    )


def build_engine(args: argparse.Namespace, workload: str, cache: bool) -> Engine:
    extra = json.loads(args.server_args)
    return Engine(
        model_path=str(args.model_path),
        load_format=args.load_format,
        device=args.device,
        seed=args.seed,
        disable_radix_cache=not cache,
        **{"context_length": longest_sequence(args, workload), **extra},
    )


def bench_run(args: argparse.Namespace, workload: str, cache: bool) -> Run:
    """Build the run's Engine, warm it up, time the workload; the Engine is garbage after."""
    engine = build_engine(args, workload, cache)
    high = min(MAX_TOKEN_ID, engine.runner.config.vocab_size - 1)

    def drawer(rng: random.Random) -> Callable[[int], list[int]]:
        return lambda n: [rng.randint(0, high) for _ in range(n)]

    runner = RUNNERS[workload]
    runner(engine, drawer(random.Random(args.seed + 1)), warmup_args(args), Run(workload, cache))
    run = Run(workload, cache)
    runner(engine, drawer(random.Random(args.seed)), args, run)
    return run


def result_row(run: Run) -> dict[str, Any]:
    prompt, cached = sum(run.prompt_lens), sum(run.cached)
    output = sum(len(ids) for ids in run.output_ids)
    requests = len(run.output_ids)
    return {
        "name": f"prefix {run.workload} cache {'on' if run.cache else 'off'}",
        "workload": run.workload,
        "cache": run.cache,
        "requests": requests,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 4),
        "output_tokens": output,
        "seconds": round(run.seconds, 3),
        "output_throughput": round(output / run.seconds, 2),
        "request_throughput": round(requests / run.seconds, 2),
        "speedup": None,  # off's seconds / on's, on the `on` row
        "identical_outputs": None,  # fraction of requests generating the same under both
    }


Outputs = list[Any]  # what each request generated, in request order: ids, or an answer's text


def compare(results: dict[str, tuple[dict[str, Any], Outputs]]) -> None:
    """With both cache settings run (`results`: setting -> its row and outputs), fill in the
    speed-up on the `on` row and the fraction of requests that generated the same on both."""
    if set(results) != {"on", "off"}:
        return
    (on, on_outputs), (off, off_outputs) = results["on"], results["off"]
    on["speedup"] = round(off["seconds"] / on["seconds"], 3)
    pairs = list(zip(on_outputs, off_outputs, strict=True))
    on["identical_outputs"] = off["identical_outputs"] = round(
        sum(a == b for a, b in pairs) / len(pairs), 4
    )


# ---- decode steps -------------------------------------------------------------------------------


def decode_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Decode ms per step at each `--decode-bs`, the cache on and off (see the module docstring)."""
    max_new = SCHEDULER_WARMUP_STEPS + args.decode_steps + 8
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    runner = build_runner(
        str(args.model_path), device, max(args.decode_bs), args.decode_context + max_new + 8
    )
    high = min(MAX_TOKEN_ID, runner.config.vocab_size - 1)
    rows = []
    for bs in args.decode_bs:
        ms = {}
        for setting in args.cache:
            rng = random.Random(args.seed + bs)
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
            reqs = [
                Req(
                    str(i),
                    [rng.randint(0, high) for _ in range(args.decode_context)],
                    params,
                    0,
                    max_new,
                )
                for i in range(bs)
            ]
            sched = bench_scheduler(runner, prefix_cache=setting == "on")
            ms[setting] = scheduler_decode_ms(sched, reqs, args.decode_steps)
        for setting, value in ms.items():
            rows.append(
                {
                    "name": f"prefix decode bs{bs} cache {setting}",
                    "workload": "decode",
                    "cache": setting == "on",
                    "bs": bs,
                    "context": args.decode_context,
                    "steps": args.decode_steps,
                    "step_ms": round(value, 4),
                    "overhead_ms": round(value - ms["off"], 4) if "off" in ms else None,
                }
            )
    del runner
    release_memory()
    return rows


# ---- gsm8k through a server ---------------------------------------------------------------------


def gsm8k_run(
    args: argparse.Namespace, cache: bool, folder: Path
) -> tuple[dict[str, Any], Outputs]:
    """Ask the gsm8k questions of a server started with the cache on or off; its row and its
    answers (in question order)."""
    setting = "on" if cache else "off"
    server_args = ["--model-path", args.gsm8k_model, "--device", args.device]
    server_args += shlex.split(args.gsm8k_server_args)
    if not cache:
        server_args.append("--disable-radix-cache")
    metrics_path, dump = folder / f"gsm8k_{setting}.json", folder / f"gsm8k_{setting}.jsonl"
    eval_args = ["--eval-name", "gsm8k", "--num-shots", str(GSM8K_SHOTS), "--no-progress"]
    eval_args += [
        "--num-examples",
        str(args.gsm8k_examples),
        "--parallel",
        str(args.gsm8k_parallel),
    ]
    eval_args += ["--max-tokens", str(GSM8K_MAX_TOKENS), "--json", str(metrics_path)]
    eval_args += ["--dump", str(dump), "--seed", str(args.seed)]
    with launched_server(server_args, folder / f"server_{setting}.log") as url:
        if run_eval.main([*eval_args, "--base-url", f"{url}/v1"]) != 0:
            raise RuntimeError(f"gsm8k with the cache {setting} failed (see its output above)")
    m = json.loads(metrics_path.read_text())["metrics"]
    answers = [json.loads(line)["completion"] for line in dump.read_text().splitlines()]
    row = {
        "name": f"prefix gsm8k cache {setting}",
        "workload": "gsm8k",
        "cache": cache,
        "model": args.gsm8k_model,
        "requests": m["num_examples"],
        "accuracy": round(m["accuracy"], 4),
        "errors": m["errors"],
        "output_tokens": m["output_tokens"],
        "seconds": round(m["latency_s"], 3),
        "output_throughput": round(m["output_throughput"], 2),
        "request_throughput": round(m["num_examples"] / m["latency_s"], 2),
        "speedup": None,
        "identical_outputs": None,
    }
    return row, answers


# ---- output -------------------------------------------------------------------------------------


def _maybe(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The Engine workloads' rows, then (when run) gsm8k's."""
    lines = [
        "| workload | cache | requests | prompt tokens | cached tokens | hit rate | seconds "
        "| output tok/s | req/s | speed-up | identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gsm8k = [
        "| gsm8k | cache | questions | accuracy | seconds | output tok/s | req/s | speed-up "
        "| identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    decode = [
        "| decode batch | cache | ms per step | excess over off (ms) |",
        "|---:|---|---:|---:|",
    ]
    for r in rows:
        cache = "on" if r["cache"] else "off"
        if r["workload"] == "decode":
            decode.append(
                f"| {r['bs']} | {cache} | {r['step_ms']:.3f} | {_maybe(r['overhead_ms'], '.3f')} |"
            )
            continue
        tail = (
            f"{r['seconds']:.2f} | {r['output_throughput']:.0f} | {r['request_throughput']:.1f} | "
            f"{_maybe(r['speedup'], '.2f')} | {_maybe(r['identical_outputs'], '.1%')} |"
        )
        if r["workload"] == "gsm8k":
            gsm8k.append(
                f"| {r['model']} | {cache} | {r['requests']} | {r['accuracy']:.1%} | {tail}"
            )
            continue
        lines.append(
            f"| {r['workload']} | {cache} | {r['requests']} | {r['prompt_tokens']} | "
            f"{r['cached_tokens']} | {r['cache_hit_rate']:.1%} | {tail}"
        )
    extra = [[""] + table for table in (decode, gsm8k) if len(table) > 2]
    return "\n".join(lines + [line for table in extra for line in table])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", type=Path, default=config_path("qwen3-0.6b"))
    parser.add_argument("--load-format", default="dummy", help="default: %(default)s")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--cache",
        nargs="+",
        choices=("on", "off"),
        default=["on", "off"],
        help="the prefix cache's settings to run each workload with",
    )
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--num-requests", type=int, default=512, help="shared_prefix's requests")
    parser.add_argument("--prefix-len", type=int, default=2000, help="the shared prefix's tokens")
    parser.add_argument("--suffix-len", type=int, default=48, help="each request's own tokens")
    parser.add_argument("--conversations", type=int, default=64, help="multi_turn's")
    parser.add_argument("--turns", type=int, default=4, help="multi_turn's turns")
    parser.add_argument("--user-len", type=int, default=256, help="tokens per user message")
    parser.add_argument(
        "--server-args",
        default="{}",
        help="further Engine (ServerArgs) fields as a JSON object, e.g. "
        "'{\"max_running_requests\": 512}'",
    )
    parser.add_argument("--seed", type=int, default=0, help="the prompts' and the weights'")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--decode-bs", nargs="*", type=int, default=[], help="also time decode steps at these"
    )
    parser.add_argument("--decode-context", type=int, default=512, help="decode prompts' tokens")
    parser.add_argument("--decode-steps", type=int, default=100, help="timed decode steps")
    parser.add_argument("--gsm8k", action="store_true", help="also time the gsm8k eval")
    parser.add_argument(
        "--gsm8k-model", default="smollm2-135m-instruct", help="the eval's model (a tokenizer)"
    )
    parser.add_argument("--gsm8k-examples", type=int, default=200, help="the first N questions")
    parser.add_argument("--gsm8k-parallel", type=int, default=128, help="requests in flight")
    parser.add_argument(
        "--gsm8k-server-args", default="", help="further launch_server flags, one string"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = ("output_len", "num_requests", "prefix_len", "conversations", "turns", "user_len")
    sizes += ("decode_context", "decode_steps")
    for name in sizes:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.suffix_len < 0:
        parser.error("--suffix-len must be at least 0")
    if not isinstance(json.loads(args.server_args), dict):
        parser.error("--server-args must be a JSON object")
    return args


def write_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    config = {**vars(args), "model_path": str(args.model_path), "json": str(args.json)}
    write_json(args.json, {"config": config, "summary": rows})


def main(argv: list[str] | None = None) -> list[Run]:
    """Run every workload under every cache setting (then gsm8k's, with --gsm8k); returns the
    Engine runs. The rows are printed, and written with --json after each run, so a run that
    fails leaves the earlier ones' rows."""
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    runs: list[Run] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"{row['name']}: {row['output_throughput']:.0f} output tok/s", flush=True)
        if args.json:
            write_rows(args, rows)

    for workload in args.workloads:
        results = {}
        for setting in args.cache:
            runs.append(bench_run(args, workload, setting == "on"))
            results[setting] = (result_row(runs[-1]), runs[-1].output_ids)
            record(results[setting][0])
            release_memory()
        compare(results)
    if args.decode_bs:
        for row in decode_rows(args):
            rows.append(row)
            print(f"{row['name']}: {row['step_ms']:.3f} ms per step", flush=True)
        if args.json:
            write_rows(args, rows)
    if args.gsm8k:
        results = {}
        with tempfile.TemporaryDirectory(prefix="bench_prefix_") as folder:
            for setting in args.cache:
                results[setting] = gsm8k_run(args, setting == "on", Path(folder))
                record(results[setting][0])
        compare(results)
    if args.json:
        write_rows(args, rows)
    print(f"\n{markdown_table(rows)}")
    return runs


if __name__ == "__main__":
    main()
