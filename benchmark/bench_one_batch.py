"""Latency of one batch, per CUDA-graph mode: prefill and decode steps, eager vs graph.

    python benchmark/bench_one_batch.py [--models qwen3-0.6b llama-3.1-8b] [--bs 1 8 64]
                                        [--input-len 512] [--json out.json]

Dummy weights with real architectures' configs (benchmark/configs/). For each model one
ModelRunner is built with `decode: full` (its capture time and graph memory are reported); the
eager numbers run the same model and batch through the eager path. Times are CUDA-event medians
after warm-up. The decode floor is the bytes a step must read (weights + the batch's KV) over the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

CONFIGS = Path(__file__).resolve().parent / "configs"
WARMUP, REPEAT = 10, 50


def cuda_time_ms(fn, warmup: int = WARMUP, repeat: int = REPEAT) -> float:
    """Median milliseconds of `fn()` by CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written per second), 1 GiB buffers."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, repeat=20)
    return 2 * src.numel() / (ms / 1e3) / 1e9


def build_runner(model: str, max_bs: int, input_len: int) -> ModelRunner:
    """Default decode shapes (up to 256: what capture time and memory are reported for)."""
    return ModelRunner(ServerArgs(
        model_path=str(CONFIGS / f"{model}.json"), load_format="dummy", device="cuda",
        dtype="bfloat16", max_running_requests=256, context_length=input_len + 64,
        max_total_tokens=max_bs * (input_len + 64), decode_cuda_graph_mode="full",
        mem_fraction_static=0.85,
    ))


def eager_forward(runner: ModelRunner, batch) -> torch.Tensor:
    runner.attn_backend.init_forward_metadata(batch)
    return runner.model(batch.input_ids, batch.positions, batch)


def measure(runner: ModelRunner, bs: int, input_len: int) -> dict:
    """Prefill of bs prompts of input_len (eager: prefill graphs are off), then decode steps."""
    reqs = [Req(i, [(i * 31 + j) % 1000 + 10 for j in range(input_len)], SamplingParams(), 0, 8)
            for i in range(bs)]
    prefill_batch = prepare_extend(reqs, runner)
    prefill_ms = cuda_time_ms(lambda: eager_forward(runner, prefill_batch), warmup=2, repeat=5)
    for r in reqs:
        r.output_ids.append(11)
    decode_batch = prepare_decode(reqs, runner)  # replayed repeatedly: same slots each time
    graph_runner = runner.graph_runners["decode"]
    assert graph_runner.can_run(decode_batch)
    graph_ms = cuda_time_ms(lambda: graph_runner.replay(decode_batch))
    eager_ms = cuda_time_ms(lambda: eager_forward(runner, decode_batch))
    for r in reqs:
        release(r, runner)
    return {"prefill_ms": prefill_ms, "decode_eager_ms": eager_ms, "decode_full_ms": graph_ms}


def decode_bytes(runner: ModelRunner, bs: int, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = runner.kv_pool.bytes_per_token(
        runner.config.num_hidden_layers, runner.config.num_key_value_heads,
        runner.config.head_dim, runner.dtype,
    )
    return weights + bs * context * kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--bs", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    bandwidth = copy_bandwidth_gbs()
    rows, summary = [], []
    for model in args.models:
        runner = build_runner(model, max(args.bs), args.input_len)
        graphs = runner.graph_runners["decode"]
        capture = {"model": model, "capture_s": round(graphs.capture_seconds, 2),
                   "graph_mib": round(graphs.capture_bytes / 2**20, 1),
                   "shapes": len(graphs.shapes)}
        for bs in args.bs:
            m = measure(runner, bs, args.input_len)
            floor_ms = decode_bytes(runner, bs, args.input_len) / (bandwidth * 1e9) * 1e3
            rows.append({"model": model, "bs": bs, **{k: round(v, 3) for k, v in m.items()},
                         "eager_over_full": round(m["decode_eager_ms"] / m["decode_full_ms"], 2),
                         "floor_ms": round(floor_ms, 3),
                         "full_over_floor": round(m["decode_full_ms"] / floor_ms, 2)})
        summary.append(capture)
        del runner, graphs
        torch.cuda.empty_cache()

    print(f"\ncopy bandwidth {bandwidth:.0f} GB/s; input length {args.input_len}")
    header = ("model", "bs", "prefill_ms", "decode_eager_ms", "decode_full_ms",
              "eager_over_full", "floor_ms", "full_over_floor")
    print(" ".join(f"{h:>15}" for h in header))
    for row in rows:
        print(" ".join(f"{row[h]!s:>15}" for h in header))
    for cap in summary:
        print(f"{cap['model']}: captured {cap['shapes']} decode shapes in {cap['capture_s']} s, "
              f"{cap['graph_mib']} MiB graph memory")
    key_rows = [{"model": r["model"], "bs": r["bs"], "decode_full_ms": r["decode_full_ms"],
                 "eager_over_full": r["eager_over_full"], "full_over_floor": r["full_over_floor"]}
                for r in rows if r["bs"] == 1] + summary
    if args.json:
        args.json.write_text(json.dumps({"copy_bandwidth_gbs": bandwidth, "rows": rows,
                                         "capture": summary, "summary": key_rows}, indent=2))


if __name__ == "__main__":
    main()
