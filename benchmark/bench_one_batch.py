"""Latency of one batch per CUDA-graph mode: prefill and decode steps, eager vs graphs.

    python benchmark/bench_one_batch.py [--models qwen3-0.6b llama-3.1-8b] [--bs 1 8 64]
                                        [--context 512] [--runs JSON ...] [--json out.json]
                                        [--server-args '{}' '{"small_batch_matmul": "triton"}']
                                        [--tp-size 1 2 4]

Dummy weights with real architectures' configs (benchmark/configs/). Per model one ModelRunner is
built per run (default: `{"decode": "full", "prefill": "breakable"}`, `{"decode": "breakable"}`,
`{"decode": "tc_piecewise", "prefill": "tc_piecewise"}`); each reports its capture time and graph
memory (tc_piecewise: and its compile time). Eager numbers run the same model and batch through the
eager path. Times are CUDA-event medians after warm-up, one step at a time (`graph ms`: the GPU
idles while the host fills the graph's inputs, as in a server that waits for each step's tokens).
`back-to-back ms` (decode graphs): steps issued without waiting, per step, so the host's input
copies hide behind the previous step (what the GPU alone takes, unless the host is slower). The
decode floor is the bytes a step must read (weights + the batch's KV; of a mixture of experts, the
experts its routing reaches) over the device-to-device copy bandwidth measured in this run.
`--server-args` sets further ServerArgs fields of every runner, e.g. `{"deterministic": true}` or
`{"small_batch_matmul": "triton"}` (the server flags' names, underscored); given several JSON
objects, every run is repeated for each (a "variant" column), so kernels compare on one host.
`--kernels fused native` repeats every run over the layers' torch code instead of their fused
Triton kernels (`native_only()`: eager, full and breakable run it unfused, tc_piecewise hands it
to its compiler as `--tc-piecewise-kernels native` does): what the compiler's own fusion is worth
under the same graph breaks.
`--tp-size N ...` repeats every run with the model split over N GPUs: one process per rank (each
builds its runner and runs the same steps, so the collectives meet), rank 0's times reported,
every rank's capture. Its decode rows add `all-reduce ms`: the all-reduce kernels' time per step
(torch.profiler over graph replays; with `--tp-all-reduce one-shot` the fused sum + add + norm
kernel's); its floor counts one rank's share of weights and KV.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from pathlib import Path

import torch

from replaylm.distributed.launch import run_on_ranks
from replaylm.layers.kernels import native_only
from replaylm.layers.moe.layer import FusedMoE
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_extend, release
from replaylm.server_args import ServerArgs

from common import (
    config_path,
    copy_bandwidth_gbs,
    cuda_time_ms,
    decode_batch,
    dummy_runner,
    kernel_table,
    release_memory,
    synthetic_requests,
    write_json,
)

PREFILL_CASES = [(1, 128), (1, 512), (8, 256)]  # (requests, tokens each)
RUNS = [  # --cuda-graph-mode of each runner built per model
    '{"decode": "full", "prefill": "breakable"}',
    '{"decode": "breakable", "prefill": "disabled"}',
    '{"decode": "tc_piecewise", "prefill": "tc_piecewise"}',
]
PROFILED_REPLAYS = 20  # decode replays under torch.profiler for the all-reduce's share
# in the kernels' names, lower case; peer_sum_norm: --tp-all-reduce one-shot's sum, which also
# does the residual add and RMSNorm that follow it
COLLECTIVE_KERNELS = ("nccl", "allreduce", "all_reduce", "peer_sum_norm")
RANK_TIMEOUT_S = 3600.0  # all runs of one model on one tensor-parallel size


@torch.inference_mode()
def eager_forward(runner: ModelRunner, batch) -> torch.Tensor:
    runner.attn_backend.init_forward_metadata(batch)
    return runner.model(batch.input_ids, batch.positions, batch)


def time_prefill(runner: ModelRunner, n: int, length: int, eager: bool) -> dict[str, float]:
    reqs = synthetic_requests(n, length)
    batch = prepare_extend(reqs, runner)
    graphs = runner.graph_runners["prefill"]
    assert graphs.can_run(batch)
    out = {"graph_ms": cuda_time_ms(lambda: graphs.replay(batch))}
    if eager:
        out["eager_ms"] = cuda_time_ms(lambda: eager_forward(runner, batch))
    for r in reqs:
        release(r, runner.kv)
    return out


def time_decode(runner: ModelRunner, bs: int, context: int, eager: bool) -> dict[str, float]:
    """A decode step over `context` cached tokens per request, replayed on the same slots."""
    reqs, batch = decode_batch(runner, bs, context)
    graphs = runner.graph_runners["decode"]
    assert graphs.can_run(batch)
    out = {
        "graph_ms": cuda_time_ms(lambda: graphs.replay(batch)),
        "back_to_back_ms": cuda_time_ms(lambda: graphs.replay(batch), repeat=10, calls=10),
    }
    if runner.tp.size > 1:
        kernels, _ = kernel_table(lambda: graphs.replay(batch), PROFILED_REPLAYS)
        # medians: the first collective under the profiler also waits for the other ranks to
        # start profiling
        collectives = [k for k in kernels if _collective(k["kernel"])]
        out["all_reduce_ms"] = sum(k["median_us"] * k["per_step"] for k in collectives) / 1e3
    if eager:
        out["eager_ms"] = cuda_time_ms(lambda: eager_forward(runner, batch))
    for r in reqs:
        release(r, runner.kv)
    return out


def _collective(kernel: str) -> bool:
    return any(name in kernel.lower() for name in COLLECTIVE_KERNELS)


def decode_bytes(runner: ModelRunner, bs: int, context: int) -> int:
    """What one rank's decode step reads: its weights and its KV heads' cache. Of a mixture of
    experts' layers, only the experts the step's routing reaches: as many as `bs` tokens choosing
    their top k of E experts uniformly reach on average, E * (1 - (1 - k / E) ** bs)."""
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    expert_params = {id(p) for m in moes for p in m.parameters()}
    weights = sum(
        p.numel() * p.element_size()
        for p in runner.model.parameters()
        if id(p) not in expert_params
    )
    for moe in moes:
        per_expert = sum(p.numel() * p.element_size() for p in moe.parameters()) / moe.num_experts
        reached = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** bs)
        weights += round(reached * per_expert)
    pool = runner.kv.pool
    kv = pool.bytes_per_token(
        runner.config.num_hidden_layers, pool.num_kv_heads, pool.head_dim, pool.dtype
    )
    return weights + bs * context * kv


def capture_row(model: str, runner: ModelRunner, phase: str) -> dict:
    return {
        "model": model,
        "phase": phase,
        "tp_size": runner.tp.size,
        "tp_rank": runner.tp.rank,
        **runner.cuda_graph_stats()[phase],
    }


def bench_model(
    model: str,
    runs: list[str],
    bs_list: list[int],
    context: int,
    bandwidth: float,
    extra: dict | None = None,
    kernels: str = "fused",
    tp: ServerArgs | None = None,
    tp_rank: int = 0,
) -> tuple[list[dict], list[dict]]:
    """Each run is a `--cuda-graph-mode` JSON; eager times come from the first runner. Rows and
    captures name `extra` as their "variant" and `kernels` (fused, or native: every runner built
    and timed in `native_only()`) as their "kernels". `tp`: this process is a rank of
    `run_on_ranks` (its `tp_size` and `dist_init_addr`), `tp_rank` its rank."""
    extra = extra or {}
    variant = json.dumps(extra)
    route = contextlib.nullcontext()
    if kernels == "native":
        route, extra = native_only(), {**extra, "tc_piecewise_kernels": "native"}
    if tp is not None:
        extra = {**extra, "tp_size": tp.tp_size, "dist_init_addr": tp.dist_init_addr}
    with route:
        rows, captures = _bench_runs(model, runs, bs_list, context, bandwidth, extra, tp_rank)
    for r in rows + captures:
        r.update(variant=variant, kernels=kernels)
    return rows, captures


def bench_on_ranks(tp_size: int, model: str, *bench_args) -> tuple[list[dict], list[dict]]:
    """`bench_model(model, *bench_args)` with the model split over `tp_size` GPUs: rank 0's
    rows, every rank's captures."""
    if tp_size == 1:
        return bench_model(model, *bench_args)
    group = ServerArgs(model_path=str(config_path(model)), tp_size=tp_size)
    job = functools.partial(_bench_rank, model, *bench_args)
    results = run_on_ranks(job, group, RANK_TIMEOUT_S)
    return results[0][0], [c for _, captures in results for c in captures]


def _bench_rank(*args) -> tuple[list[dict], list[dict]]:
    """`bench_model(model, *bench_args)` as `run_on_ranks` calls it: (..., group, rank)."""
    *bench_args, group, rank = args
    return bench_model(*bench_args, tp=group, tp_rank=rank)


def _bench_runs(
    model: str,
    runs: list[str],
    bs_list: list[int],
    context: int,
    bandwidth: float,
    extra: dict,
    tp_rank: int,
) -> tuple[list[dict], list[dict]]:
    rows, captures, eager = [], [], {}
    for modes in runs:
        runner = dummy_runner(model, modes, max(bs_list), context, extra, tp_rank)
        config = json.loads(modes)
        for phase in ("decode", "prefill"):
            if config.get(phase, "disabled") != "disabled":
                captures.append(capture_row(model, runner, phase))
        if config.get("prefill", "disabled") != "disabled":
            for n, length in PREFILL_CASES:
                step = f"prefill {n}x{length}"
                t = time_prefill(runner, n, length, eager=step not in eager)
                eager.setdefault(step, t.get("eager_ms"))
                rows.append(
                    {
                        "model": model,
                        "tp_size": runner.tp.size,
                        "step": step,
                        "mode": config["prefill"],
                        "eager_ms": eager[step],
                        "graph_ms": t["graph_ms"],
                        "floor_ms": None,
                    }
                )
        if config.get("decode", "disabled") != "disabled":
            for bs in bs_list:
                step = f"decode bs{bs}"
                t = time_decode(runner, bs, context, eager=step not in eager)
                eager.setdefault(step, t.get("eager_ms"))
                rows.append(
                    {
                        "model": model,
                        "tp_size": runner.tp.size,
                        "step": step,
                        "mode": config["decode"],
                        "eager_ms": eager[step],
                        "graph_ms": t["graph_ms"],
                        "back_to_back_ms": t["back_to_back_ms"],
                        **({"all_reduce_ms": t["all_reduce_ms"]} if "all_reduce_ms" in t else {}),
                        "floor_ms": decode_bytes(runner, bs, context) / (bandwidth * 1e6),
                    }
                )
        del runner
        release_memory()
    for r in rows:
        r["speedup"] = r["eager_ms"] / r["graph_ms"]
    rows.sort(key=lambda r: (not r["step"].startswith("prefill"), r["step"], r["mode"]))
    return rows, captures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--bs", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=512, help="cached tokens per request")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=RUNS,
        help="--cuda-graph-mode JSON of each runner (default: all three modes)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--server-args",
        type=json.loads,
        nargs="+",
        default=[{}],
        help="JSON object of further ServerArgs fields for every runner; "
        "several: every run once per object",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=("fused", "native"),
        default=["fused"],
        help="the layers' fused Triton kernels, or their torch code "
        "(native_only); several: every run once per choice",
    )
    parser.add_argument(
        "--tp-size",
        nargs="+",
        type=int,
        default=[1],
        help="tensor-parallel sizes (one GPU per rank); several: every run once per size",
    )
    args = parser.parse_args()

    bandwidth = copy_bandwidth_gbs()
    rows, captures = [], []
    for model in args.models:
        for tp_size in args.tp_size:
            for kernels in args.kernels:
                for extra in args.server_args:
                    if tp_size == 1 and extra.get("tp_all_reduce") == "one-shot":
                        continue  # one rank makes no sum: the NCCL variant's run again
                    model_rows, model_captures = bench_on_ranks(
                        tp_size, model, args.runs, args.bs, args.context, bandwidth, extra, kernels
                    )
                    rows += model_rows
                    captures += model_captures

    print(f"\ncopy bandwidth {bandwidth:.0f} GB/s; decode context {args.context} tokens")
    print(
        f"{'model':14} {'tp':>2} {'step':18} {'mode':13} {'eager ms':>9} {'graph ms':>9} "
        f"{'speedup':>8} {'back-to-back ms':>16} {'all-reduce ms':>14} {'floor ms':>9} "
        f"{'kernels':7}  variant"
    )
    for r in rows:
        floor = f"{r['floor_ms']:9.3f}" if r["floor_ms"] is not None else f"{'':9}"
        b2b = f"{r['back_to_back_ms']:16.3f}" if "back_to_back_ms" in r else f"{'':16}"
        reduce = f"{r['all_reduce_ms']:14.3f}" if "all_reduce_ms" in r else f"{'':14}"
        print(
            f"{r['model']:14} {r['tp_size']:2} {r['step']:18} {r['mode']:13} "
            f"{r['eager_ms']:9.3f} {r['graph_ms']:9.3f} {r['speedup']:8.2f} {b2b} {reduce} "
            f"{floor} {r['kernels']:7}  {r['variant']}"
        )
    for c in captures:
        compile_s = f" after {c['compile_s']} s compiling" if c["compile_s"] is not None else ""
        rank = f" tp{c['tp_rank']}/{c['tp_size']}" if c["tp_size"] > 1 else ""
        print(
            f"{c['model']}{rank}: {c['phase']} {c['mode']}: {c['shapes']} shapes captured in "
            f"{c['capture_s']} s{compile_s}, {c['graph_mib']} MiB  {c['kernels']} {c['variant']}"
        )
    summary = [
        {
            "model": r["model"],
            "tp_size": r["tp_size"],
            "step": r["step"],
            "mode": r["mode"],
            "variant": r["variant"],
            "kernels": r["kernels"],
            "graph_ms": round(r["graph_ms"], 3),
            "speedup": round(r["speedup"], 2),
            **(
                {"back_to_back_ms": round(r["back_to_back_ms"], 3)}
                if "back_to_back_ms" in r
                else {}
            ),
            **({"over_floor": round(r["graph_ms"] / r["floor_ms"], 2)} if r["floor_ms"] else {}),
            **(
                {"all_reduce_share": round(r["all_reduce_ms"] / r["graph_ms"], 3)}
                if "all_reduce_ms" in r
                else {}
            ),
        }
        for r in rows
        if r["step"] in ("decode bs1", "prefill 1x128")
    ] + captures
    if args.json:
        write_json(
            args.json,
            {
                "copy_bandwidth_gbs": bandwidth,
                "server_args": args.server_args,
                "kernels": args.kernels,
                "tp_size": args.tp_size,
                "rows": rows,
                "captures": captures,
                "summary": summary,
            },
        )


if __name__ == "__main__":
    main()
