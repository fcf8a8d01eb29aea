"""Where the seconds of a CUDA-graph capture go, per phase and per part of capturing a shape.

    python benchmark/tuning/bench_capture.py [--models smollm2-135m qwen3-0.6b]
                                             [--modes '{"decode": "full", "prefill": "breakable"}']
                                             [--json out.json]

A server's start captures every decode and prefill shape once, in a fresh process whose Triton
kernels come from the disk cache. Per model (a `benchmark/configs/` config, dummy weights,
default server arguments), this builds a runner the way the server does (pass "start": its
captures) and captures every phase again twice in the same process: "again" (every kernel
already loaded) and "no empty_cache" (`torch.cuda.empty_cache`, which `torch.cuda.graph` calls
before each capture, made a no-op). Each pass splits its seconds into:

- kernel loads: Triton's `_do_compile` (a kernel not yet in the process: read from the disk
  cache, or compiled), and how many;
- warm-up: the eager forward before each capture, until the GPU has run it, less its kernel
  loads;
- graph begin: `torch.cuda.graph`'s entry (synchronize, empty_cache) and capture_begin;
- graph end: capture_end (the graph's instantiation);
- rest: everything else, mostly the captured forward's launches on the host.

With a cold Triton cache, the start's compiles show in "kernel loads".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch
import triton.runtime.jit as triton_jit

from replaylm.model_executor.cuda_graph.backend import breakable, full
from replaylm.model_executor.cuda_graph.breakable_graph import BreakableCUDAGraph
from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.server_args import ServerArgs

from common import config_path, release_memory, write_json

DEFAULT_MODES = '{"decode": "full", "prefill": "breakable"}'
PARTS = ("kernel loads", "warm-up", "graph begin", "graph end")


class Timers:
    """Seconds and calls per (phase, part): the wrapped functions add to the phase whose capture
    is running (none outside a capture). A part timed inside another (a kernel load inside a
    warm-up) counts for the inner one only, so the parts never overlap."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.phase: str | None = None
        self.inner: list[float] = []  # per running part, the seconds of the parts inside it

    def wrap(self, part: str, fn: Callable[..., Any], sync: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = self.phase
            if phase is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            self.inner.append(0.0)
            try:
                out = fn(*args, **kwargs)
                if sync:
                    torch.cuda.synchronize()
                return out
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[phase, part] += elapsed - self.inner.pop()
                self.calls[phase, part] += 1
                if self.inner:
                    self.inner[-1] += elapsed

        return timed

    def row(self, phase: str, shapes: int) -> dict[str, Any]:
        """The phase's parts (then forgotten: the next pass starts from zero)."""
        seconds = self.seconds.pop((phase, "capture"))
        parts = {part: round(self.seconds.pop((phase, part), 0.0), 3) for part in PARTS}
        loads = self.calls.pop((phase, "kernel loads"), 0)
        return {
            "phase": phase,
            "shapes": shapes,
            "seconds": round(seconds, 3),
            "ms_per_shape": round(1e3 * seconds / shapes, 1),
            **parts,
            "rest": round(seconds - sum(parts.values()), 3),
            "kernels loaded": loads,
        }


def instrumented(timers: Timers) -> contextlib.ExitStack:
    """Every capture timed whole and in PARTS, by wrapping what it calls."""
    capture = BaseCudaGraphRunner.capture

    def timed_capture(graph_runner: BaseCudaGraphRunner) -> None:
        timers.phase = graph_runner.phase
        start = time.perf_counter()
        try:
            capture(graph_runner)
        finally:
            timers.seconds[graph_runner.phase, "capture"] += time.perf_counter() - start
            timers.phase = None

    stack = contextlib.ExitStack()
    stack.enter_context(patch.object(BaseCudaGraphRunner, "capture", timed_capture))
    timed: list[tuple[Any, str, str]] = [  # (owner, attribute, part)
        (triton_jit.JITFunction, "_do_compile", "kernel loads"),
        (full, "warm_up", "warm-up"),
        (breakable, "warm_up", "warm-up"),
        (torch.cuda.graph, "__enter__", "graph begin"),
        (torch.cuda.graph, "__exit__", "graph end"),
        (BreakableCUDAGraph, "_begin", "graph begin"),
        (BreakableCUDAGraph, "_end", "graph end"),
    ]
    for owner, name, part in timed:
        # a warm-up is timed until the GPU has run it
        wrapped = timers.wrap(part, getattr(owner, name), sync=part == "warm-up")
        stack.enter_context(patch.object(owner, name, wrapped))
    return stack


def bench_model(model: str, modes: str) -> list[dict[str, Any]]:
    """Rows of the start's captures, then of each phase captured again, then again with
    empty_cache a no-op."""
    timers = Timers()
    args = ServerArgs(
        model_path=str(config_path(model)),
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        cuda_graph_mode=modes,
    )
    rows: list[dict[str, Any]] = []
    with instrumented(timers):
        runner = load_model_runner(
            resolve_engine_config(args)
        )  # captures each phase in turn, as a server's start does
        for pass_name in ("start", "again", "no empty_cache"):
            if pass_name != "start":
                noop = patch.object(torch.cuda, "empty_cache", lambda: None)
                with noop if pass_name == "no empty_cache" else contextlib.nullcontext():
                    for graph_runner in runner.graph_runners.values():
                        graph_runner.capture()
            for phase, graph_runner in runner.graph_runners.items():
                row = timers.row(phase, len(graph_runner.shapes))
                rows.append({"model": model, "pass": pass_name, **row})
    runner.free_cuda_graphs()
    del runner
    release_memory()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-0.6b"])
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [row for model in args.models for row in bench_model(model, args.modes)]
    columns = ["model", "pass", "phase", "shapes", "seconds", "ms_per_shape", *PARTS, "rest"]
    columns.append("kernels loaded")
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row.get(c, "")) for c in columns))
    if args.json:
        write_json(args.json, {"modes": json.loads(args.modes), "rows": rows})


if __name__ == "__main__":
    main()
