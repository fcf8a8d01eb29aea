"""Where a graphed decode step's GPU time goes: kernels by name, their sum, and the gaps.

    python benchmark/tuning/bench_profile.py [--models qwen3-0.6b ...] [--bs 1] [--context 512]
                                             [--mode '{"decode": "full"}'] [--server-args JSON ...]
                                             [--json out.json]

Per model and per `--server-args` object (a variant: e.g. `{"small_batch_matmul": "triton"}`),
builds one runner (dummy weights, as benchmark/bench_one_batch.py builds them), times the decode
replay with CUDA events (median), then replays it under torch.profiler and groups the CUDA
kernels by name. Per step: the replay time, the kernels' summed time, their count, and the rest
("gaps": launch latency between kernels, host work inside the timed region; negative when PDL
overlaps kernels, whose times then include their wait for the one before). The table is what a
kernel fusion or a launch change has to move.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch

from replaylm.model_executor.model_runner import ModelRunner

from common import (
    cuda_time_ms,
    decode_batch,
    dummy_runner,
    kernel_table,
    release_memory,
    write_json,
)

PROFILED_REPLAYS = 10


@torch.inference_mode()
def measure_decode(
    runner: ModelRunner, bs: int, context: int, mode: str
) -> tuple[float, list[dict], float]:
    """(median replay ms, kernel rows, kernel us per step) of `runner`'s decode graph."""
    _, batch = decode_batch(runner, bs, context)
    graphs = runner.graph_runners["decode"]
    if graphs is None or not graphs.can_run(batch):
        raise SystemExit(f"no decode graph serves bs={bs} under {mode}")
    step_ms = cuda_time_ms(lambda: graphs.replay(batch))
    return step_ms, *kernel_table(lambda: graphs.replay(batch), PROFILED_REPLAYS)


def profile_variant(model: str, args: argparse.Namespace, extra: dict) -> dict:
    """Print and return the profile of `model`'s decode step under the ServerArgs `extra`."""
    runner = dummy_runner(model, args.mode, args.bs, args.context, extra)
    step_ms, rows, kernel_us = measure_decode(runner, args.bs, args.context, args.mode)
    del runner
    release_memory()
    launches = sum(r["per_step"] for r in rows)
    gap_us = step_ms * 1e3 - kernel_us
    print(f"\n{model} decode bs{args.bs} ctx{args.context} {args.mode} {json.dumps(extra)}")
    print(
        f"step {step_ms * 1e3:.1f} us = kernels {kernel_us:.1f} us ({launches:.0f} launches) "
        f"+ gaps {gap_us:.1f} us ({gap_us / max(launches, 1):.2f} us per launch)"
    )
    print(f"{'kernel':60} {'per step':>8} {'each us':>8} {'share':>6}")
    for r in rows:
        print(
            f"{r['kernel'][:60]:60} {r['per_step']:8.1f} {r['each_us']:8.2f} "
            f"{100 * r['total_us'] / kernel_us:5.1f}%"
        )
    return {
        "model": model,
        "step": f"decode bs{args.bs}",
        "mode": args.mode,
        "variant": json.dumps(extra),
        "step_us": round(step_ms * 1e3, 1),
        "kernel_us": round(kernel_us, 1),
        "launches": launches,
        "gap_us": round(gap_us, 1),
        "kernels": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--bs", type=int, default=1)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per request")
    parser.add_argument(
        "--mode",
        default='{"decode": "full", "prefill": "disabled"}',
        help="--cuda-graph-mode JSON of the runner",
    )
    parser.add_argument(
        "--server-args",
        type=json.loads,
        nargs="+",
        default=[{}],
        help="JSON objects of further ServerArgs fields: one profile each",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    profiles = [
        profile_variant(model, args, extra) for model in args.models for extra in args.server_args
    ]
    print(f"\n{'model':14} {'step us':>8} {'kernel us':>9} {'launches':>8}  variant")
    for p in profiles:
        print(
            f"{p['model']:14} {p['step_us']:8.1f} {p['kernel_us']:9.1f} {p['launches']:8.0f}  "
            f"{p['variant']}"
        )
    if args.json:
        summary = [{k: v for k, v in p.items() if k != "kernels"} for p in profiles]
        write_json(args.json, {"summary": summary, "profiles": profiles})


if __name__ == "__main__":
    main()
