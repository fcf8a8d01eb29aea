"""Server (and Engine) start to first token, per CUDA-graph mode, cold and with a warm compile
cache, stage by stage.

    python benchmark/bench_startup.py [--model-path benchmark/configs/qwen3-0.6b.json]
        [--load-format dummy] [--modes JSON ...] [--device cuda] [--engine]
        [--no-bytecode-cache] [--json out.json]

For each `--cuda-graph-mode` JSON a `launch_server` process is started and POST /generate (one
token for a fixed 16-token prompt) is retried until it answers: the time from spawning the
process to that answer is the start time. Every mode starts twice: "cold", with every cache a
start fills empty (`--compile-cache-dir`, Triton's kernel cache, replaylm's tokenizer cache: a
fresh folder each), then "warm", on the caches the cold start filled. `--engine` then times the
offline Engine the same way in a fresh process (imports, `Engine(...)`, one token), warm.

Python's bytecode is part of an installed package (pip compiles it at install), not of a start:
before the first start, every package a start imports is compiled into a bytecode cache of the
run's own (`PYTHONPYCACHEPREFIX`), which every start then reads. An environment that ships its
packages without bytecode and writes none (`PYTHONDONTWRITEBYTECODE`) compiles each module it
imports from source on every start: `--no-bytecode-cache` measures it as it is.

Where the seconds went: each process logs its start-up stages as they end (`startup stage ...`,
see replaylm/startup_stages.py) and the server reports them at /get_server_info. A start's table
lists every stage of both processes by the time it ended: the HTTP process's stages, from the
spawn to its first token, add up to the start time; the scheduler process's, from its own spawn
to its ready message, ran beside them (the HTTP process's "wait for the model" is their tail).
Each stage also gives the CPU seconds its process spent in it: far fewer than its seconds means
it waited (for the other process, the GPU, or a CPU other processes kept busy).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = [
    '{"decode": "disabled", "prefill": "disabled"}',
    '{"decode": "full", "prefill": "breakable"}',
    '{"decode": "breakable", "prefill": "breakable"}',
    '{"decode": "tc_piecewise", "prefill": "tc_piecewise"}',
]
PROMPT = list(range(100, 116))
TIMEOUT_S = 600.0
BENCH = "bench"  # the process named by the stages this benchmark measures itself


# what a start imports: each top-level package these pull in is compiled whole (lazy imports too)
STARTUP_MODULES = (
    "replaylm.launch_server",
    "replaylm.entrypoints.http_server",
    "replaylm.runtime.scheduler_process",
    "replaylm.model_loader.gguf_loader",
    "transformers",  # a first start converts a GGUF's tokenizer with it
    "torch._dynamo",
    "torch._inductor.compile_fx",
)


def fill_bytecode_cache(env: dict[str, str]) -> float:
    """Compile every package that STARTUP_MODULES import (found by importing them in a child
    process: `_import_roots`), replaylm's included, into `env`'s PYTHONPYCACHEPREFIX, as
    installing them would; seconds taken."""
    start = time.perf_counter()
    found = subprocess.run(
        [sys.executable, __file__, "--import-roots"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if found.returncode != 0:
        raise RuntimeError(f"finding the start-up's packages failed:\n{found.stderr[-2000:]}")
    # check=False: a package may ship files of a newer Python's syntax (tests), never imported
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *found.stdout.split()],
        env=env,
        capture_output=True,
        check=False,
    )
    return time.perf_counter() - start


def _import_roots() -> None:
    """Print the top-level package (or module) of every Python file STARTUP_MODULES import,
    outside the standard library, one path a line."""
    for name in STARTUP_MODULES:
        importlib.import_module(name)
    stdlib = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    entries = {os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)} - stdlib
    entries = sorted(entries, key=len, reverse=True)  # site-packages before a folder above it
    roots = set()
    for module in list(sys.modules.values()):
        path = os.path.abspath(getattr(module, "__file__", None) or "")
        entry = next((e for e in entries if path.startswith(e + os.sep)), None)
        if entry is not None and path.endswith(".py"):
            roots.add(os.path.join(entry, path[len(entry) + 1 :].split(os.sep)[0]))
    print("\n".join(sorted(roots)))


def server_start(server_args: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Start `launch_server server_args` in `env`, time it to its first generated token, read
    its start-up stages from /get_server_info and stop it: {"seconds", "stages"} (see
    `timeline`). Raises RuntimeError (with the log's tail) if it dies or never answers."""
    import httpx  # here: the Engine's process (this script too) should not import it

    from common import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "replaylm.launch_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *server_args,
    ]
    base = f"http://127.0.0.1:{port}"
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    with log.open("w") as out:
        spawned, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while time.perf_counter() - start < TIMEOUT_S:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                    )
                try:
                    if httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT_S).is_success:
                        seconds = time.perf_counter() - start
                        startup = httpx.get(f"{base}/get_server_info", timeout=60).json()["startup"]
                        stages = timeline([startup["http"], startup["scheduler"]], spawned, seconds)
                        return {"seconds": seconds, "stages": stages}
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            raise RuntimeError(
                f"no first token after {TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}"
            )
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def timeline(
    processes: list[dict[str, Any]], spawned: float, first_token_s: float | None = None
) -> list[dict[str, Any]]:
    """Every stage of a start as {"process", "name", "seconds", "cpu_s", "end_s"} (`end_s`:
    seconds from `spawned`, epoch seconds, to its end), ordered by end: the bench's `spawn` (to
    the start of the first of `processes`, the one it spawned), the stages of each of
    `processes` (StartupStages.to_dict()s), and `first token` (after the first one's stages)
    when `first_token_s` (seconds from `spawned`) is given."""
    front = processes[0]
    spawn = max(front["started_at"] - spawned, 0.0)  # the process's start, to a clock tick
    rows = [_row(BENCH, "spawn", spawn, None, spawn)]
    for doc in processes:
        end = max(doc["started_at"] - spawned, 0.0)
        for stage in doc["stages"]:
            end += stage["seconds"]
            rows.append(_row(doc["process"], stage["name"], stage["seconds"], stage["cpu_s"], end))
    if first_token_s is not None:
        # where the front's last stage row ends (the same additions): its rounded stages may
        # add up a tick past its rounded total_s
        ready = sum((stage["seconds"] for stage in front["stages"]), spawn)
        # the server's clock and the bench's agree to a tick: a token at once reads as 0, not
        # -0.001, and ends with the server's last stage, not a tick before it
        first = max(first_token_s - ready, 0.0)
        rows.append(_row(BENCH, "first token", first, None, ready + first))
    return sorted(rows, key=lambda r: r["end_s"])


def _row(
    process: str, name: str, seconds: float, cpu_s: float | None, end_s: float
) -> dict[str, Any]:
    return {"process": process, "name": name, "seconds": seconds, "cpu_s": cpu_s, "end_s": end_s}


def engine_start(engine_args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Time the offline Engine in a fresh process in `env` to its first generated token (its
    last stage): {"seconds", "stages"} (`timeline`'s rows, process `engine`)."""
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--engine-child", json.dumps(engine_args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"engine start failed ({done.returncode}):\n{done.stderr[-3000:]}")
    startup = json.loads(done.stdout.splitlines()[-1])
    stages = timeline([startup], spawned)
    return {"seconds": stages[-1]["end_s"], "stages": stages}  # not the process's exit


def _engine_child(engine_args: dict[str, Any]) -> None:
    """The Engine's process: its stages from its own start (imports, the Engine's own, the
    first token), printed as one JSON line. Nothing else is imported first (not `common`, whose
    imports no Engine user pays)."""
    from replaylm.startup_stages import StartupStages

    stages = StartupStages.from_process_start("engine")
    from replaylm.entrypoints.engine import Engine

    stages.mark("imports")
    engine = Engine(startup_stages=stages, **engine_args)
    engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1, "temperature": 0})
    stages.mark("first token")
    print(json.dumps(stages.to_dict()))


def print_start(title: str, start: dict[str, Any]) -> None:
    print(f"\n{title}: first token {start['seconds']:.2f} s")
    print(f"  {'process':10} {'stage':26} {'seconds':>8} {'cpu':>6} {'ends at':>8}")
    for r in start["stages"]:
        cpu = f"{r['cpu_s']:6.2f}" if r["cpu_s"] is not None else f"{'':6}"
        print(f"  {r['process']:10} {r['name']:26} {r['seconds']:8.2f} {cpu} {r['end_s']:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: dummy Qwen3-0.6B's config")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument(
        "--engine", action="store_true", help="time the offline Engine's start too, per mode"
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep each server's log here (default: a temporary directory)",
    )
    parser.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="leave Python's bytecode cache as the environment sets it (default: a cache of the "
        "run's own, filled before the first start)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--engine-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--import-roots", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child is not None:
        _engine_child(json.loads(args.engine_child))
        return
    if args.import_roots:
        _import_roots()
        return
    from common import config_path, write_json

    args.model_path = args.model_path or str(config_path("qwen3-0.6b"))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_startup_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows, engine_rows = [], []
    python_env = dict(os.environ)
    if not args.no_bytecode_cache:
        python_env.pop("PYTHONDONTWRITEBYTECODE", None)
        python_env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="startup_bytecode_")
        seconds = fill_bytecode_cache(python_env)
        print(f"bytecode of the packages a start imports compiled in {seconds:.1f} s")
    for i, modes in enumerate(args.modes):
        caches = Path(tempfile.mkdtemp(prefix="startup_caches_"))
        env = {
            **python_env,
            "REPLAYLM_CACHE_DIR": str(caches / "replaylm"),
            "TRITON_CACHE_DIR": str(caches / "triton"),
        }
        common_args = {
            "model_path": args.model_path,
            "load_format": args.load_format,
            "device": args.device,
            "cuda_graph_mode": modes,
            "compile_cache_dir": str(caches / "compile"),
        }
        cli = [a for k, v in common_args.items() for a in (f"--{k.replace('_', '-')}", v)]
        for start in ("cold", "warm"):
            row = {"modes": json.loads(modes), "start": start}
            row |= server_start(cli, log_dir / f"server_{i}_{start}.log", env)
            rows.append(row)
            print_start(f"server {modes} {start}", row)
        if args.engine:
            row = {"modes": json.loads(modes), "start": "warm", **engine_start(common_args, env)}
            engine_rows.append(row)
            print_start(f"engine {modes} warm", row)

    tc_cold = next(
        (
            r["seconds"]
            for r in rows
            if r["start"] == "cold" and "tc_piecewise" in r["modes"].values()
        ),
        None,
    )
    print(f"\n{'decode':14} {'prefill':14} {'start':6} {'seconds':>8} {'of tc cold':>11}")
    for r in rows:
        share = f"{r['seconds'] / tc_cold:10.0%}" if tc_cold else f"{'':>10}"
        r["of_tc_piecewise_cold"] = r["seconds"] / tc_cold if tc_cold else None
        print(
            f"{r['modes']['decode']:14} {r['modes']['prefill']:14} {r['start']:6} "
            f"{r['seconds']:8.1f} {share}"
        )
    if args.json:
        summary = [
            {
                "decode": r["modes"]["decode"],
                "prefill": r["modes"]["prefill"],
                "start": r["start"],
                "seconds": round(r["seconds"], 1),
            }
            for r in rows
        ]
        doc = {
            "model_path": args.model_path,
            "bytecode_cache": not args.no_bytecode_cache,
            "rows": rows,
            "engine": engine_rows,
        }
        write_json(args.json, {**doc, "summary": summary})


if __name__ == "__main__":
    main()
