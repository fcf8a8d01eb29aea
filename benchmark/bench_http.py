"""The HTTP server against the in-process Engine: what the front end costs.

    python benchmark/bench_http.py [--model-path benchmark/configs/smollm2-135m.json ...]
        [--load-format dummy] [--tokenizer-path PATH] [--num-prompts 1024] [--input-len 512]
        [--output-len 128] [--api-server-count 1 2 4] [--client-processes 4] [--no-engine]
        [--device auto] [--server-args ARG ...] [--json out.json]

For each `--model-path`: first (unless `--no-engine`) the in-process Engine generates for
`--num-prompts` random prompts of `--input-len` tokens, `--output-len` tokens each
(`bench_offline.py`, full decode graphs). Then, per `--api-server-count`, `launch_server` serves
the same model and `bench_serving.py` sends as many such requests at once, streamed, from
`--client-processes` client processes (one Python process cannot parse tens of thousands of chunks
a second). A row: output tokens per second (and as a share of the Engine's), TTFT and inter-token
latency percentiles, and the CPU seconds the front-end processes spent per streamed token (read
from /proc before and after the run, for the processes `/get_server_info` names). The Engine's row
gives its mean step: the run's seconds over its output length, what a decode step costs with the
prefills spread over it. A dummy config whose vocabulary is larger than the tokenizer's is served
with the tokenizer's (a copy of the config; `vocab_size_cut_to` in the JSON), so that every sampled
id detokenizes.

On the CPU (`--device cpu`, the default model then SmolLM2's vocabulary on a tiny body, with
the built-in model's tokenizer) the scheduler is the slow part, every chunk carries one token,
and the CPU per streamed token is the front end's cost alone. `--json` writes `{"config", "rows"}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.tokenizer import load_tokenizer

from common import BENCHMARK_DIR, CONFIGS, launched_server, write_json

# the CPU's model: SmolLM2's vocabulary (its tokenizer detokenizes every token) on a tiny body
TINY_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "torch_dtype": "float32",
}
IDLE_CPU_S = 0.05  # CPU seconds a second of an idle front end stays under
PIDS_TRIES = 200  # fresh connections asked which front end answers, to find every process


def engine_row(args: argparse.Namespace, model_path: str, folder: Path) -> dict[str, Any]:
    """The in-process Engine on the workload, through bench_offline.py."""
    out = folder / "engine.json"
    cmd = [
        sys.executable, str(BENCHMARK_DIR / "bench_offline.py"),
        "--model-path", model_path, "--load-format", args.load_format,
        "--num-seqs", str(args.num_prompts), "--min-len", str(args.input_len),
        "--max-len", str(args.input_len), "--output-len", str(args.output_len),
        "--modes", "full", "--device", args.device, "--json", str(out),
    ]  # fmt: skip
    if args.engine_args:
        cmd += ["--server-args", args.engine_args]
    subprocess.run(cmd, check=True)
    (row,) = json.loads(out.read_text())["summary"]
    return {
        "setting": "engine",
        "output_tok_s": row["output_throughput"],
        "seconds": row["seconds"],
        "mean_step_ms": row["seconds"] / args.output_len * 1e3,
    }


def front_end_pids(url: str, count: int) -> list[int]:
    """The pids of the server's `count` front ends, from /get_server_info over fresh
    connections (the kernel hands each to whichever process accepts first)."""
    pids: dict[int, int] = {}
    for _ in range(PIDS_TRIES):
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()["api_server"]
        pids[info["index"]] = info["pid"]
        if len(pids) == count:
            return list(pids.values())
        time.sleep(0.01)
    raise RuntimeError(f"found {len(pids)} of {count} front ends: {sorted(pids)}")


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of `pids` so far (every thread), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def wait_idle(pids: list[int], timeout_s: float = 120.0) -> None:
    """Wait until `pids` spend almost no CPU for a second: the front ends' start-up work in the
    background (the structured-output engine's import) is not the streaming's cost."""
    deadline = time.monotonic() + timeout_s
    last = cpu_seconds(pids)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = cpu_seconds(pids)
        if now - last < IDLE_CPU_S:
            return
        last = now
    raise RuntimeError(f"the front ends did not go idle in {timeout_s:.0f} s")


def http_row(args: argparse.Namespace, model_path: str, count: int, folder: Path) -> dict[str, Any]:
    """`launch_server` with `count` front ends under the workload, through bench_serving.py."""
    server_args = [
        "--model-path", model_path, "--load-format", args.load_format,
        "--device", args.device, "--api-server-count", str(count),
        "--max-running-requests", str(args.num_prompts), "--log-level", "warning",
        *(["--tokenizer-path", args.tokenizer_path] if args.tokenizer_path else []),
        *args.server_args,
    ]  # fmt: skip
    out = folder / f"serving_{count}.json"
    with launched_server(server_args, folder / f"server_{count}.log") as url:
        pids = front_end_pids(url, count)
        wait_idle(pids)
        before = cpu_seconds(pids)
        cmd = [
            sys.executable, str(BENCHMARK_DIR / "bench_serving.py"), "--base-url", url,
            "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
            "--request-rate", "inf", "--client-processes", str(args.client_processes),
            "--disable-tqdm", "--json", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        spent = cpu_seconds(pids) - before
    (row,) = json.loads(out.read_text())["summary"]
    tokens = row["total_output_tokens"]
    return {
        "setting": "http",
        "api_server_count": count,
        "completed": row["completed"],
        "failed": row["failed"],
        "output_tok_s": row["output_token_throughput"],
        **{k: row[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")},
        "front_end_cpu_s": round(spent, 2),
        # the warm-up request's tokens are in the CPU time too: a rounding error at this scale
        "front_end_cpu_us_per_token": round(spent / tokens * 1e6, 1) if tokens else None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-path", nargs="+", default=None, help="default: SmolLM2-135M's config"
    )
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument(
        "--tokenizer-path", default=None, help="default: the built-in model's, for dummy configs"
    )
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--api-server-count", type=int, nargs="+", default=[1])
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--no-engine", action="store_true", help="HTTP rows only")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--server-args", nargs="*", default=[], help="further launch_server flags, e.g. --foo=1"
    )
    parser.add_argument(
        "--engine-args", default=None, help="a JSON object of ServerArgs fields for the Engine"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.model_path is None:
        args.model_path = [str(CONFIGS / "smollm2-135m.json")]
    if args.tokenizer_path is None and args.load_format == "dummy":
        args.tokenizer_path = resolve_model_path("smollm2-135m-instruct")
    return args


def served_config(
    args: argparse.Namespace, model_path: str, folder: Path
) -> tuple[str, int | None]:
    """The config to serve for `model_path`, and the vocabulary it was cut to (None: as it is).
    On the CPU the default model is a tiny body; a dummy config with more ids than the tokenizer
    has gets the tokenizer's vocabulary."""
    if args.load_format != "dummy" or not model_path.endswith(".json"):
        return model_path, None
    config = json.loads(Path(model_path).read_text())
    if args.device == "cpu" and model_path == str(CONFIGS / "smollm2-135m.json"):
        config |= TINY_SIZES
        model_path = str(folder / "smollm2-135m-tiny.json")
    cut = None
    if args.tokenizer_path is not None:
        tokenizer = load_tokenizer(args.tokenizer_path)
        if tokenizer is not None and config["vocab_size"] > len(tokenizer):
            cut = config["vocab_size"] = len(tokenizer)
            model_path = str(folder / f"{Path(model_path).stem}.json")
    if model_path.startswith(str(folder)):
        Path(model_path).write_text(json.dumps(config))
    return model_path, cut


def model_rows(args: argparse.Namespace, model_path: str, folder: Path) -> list[dict[str, Any]]:
    """The Engine's row (unless --no-engine) and a row per front-end count, for one model."""
    rows: list[dict[str, Any]] = []
    engine = None if args.no_engine else engine_row(args, model_path, folder)
    if engine is not None:
        rows.append(engine)
    for count in args.api_server_count:
        row = http_row(args, model_path, count, folder)
        if engine is not None:
            row["vs_engine"] = round(row["output_tok_s"] / engine["output_tok_s"], 3)
            row["itl_p50_vs_step"] = round(row["p50_itl_ms"] / engine["mean_step_ms"], 2)
        rows.append(row)
        print(json.dumps(row))
    return [{"model": Path(model_path).stem, **row} for row in rows]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    served: list[str] = []
    cuts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        folder = Path(tmp)
        for given in args.model_path:
            model_path, cut = served_config(args, given, folder)
            served.append(Path(model_path).name)
            if cut is not None:
                cuts[Path(model_path).stem] = cut
            rows += model_rows(args, model_path, folder)
    if args.json:  # the served configs by file name: a made one's folder is gone
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        config |= {"model_path": served, "vocab_size_cut_to": cuts}
        write_json(args.json, {"config": config, "rows": rows})


if __name__ == "__main__":
    main()
