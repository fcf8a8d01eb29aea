"""Host time of a step-by-step server's decode step: building the batch, and the whole step.

    python benchmark/tuning/bench_decode_host.py [--model-path benchmark/configs/qwen3-0.6b.json]
                                                 [--bs 1 8 32] [--context 512] [--steps 100]
                                                 [--device cuda] [--json out.json]

benchmark/bench_one_batch.py times the graph replay alone. A server also builds every step's
batch on the host (`prepare_decode`: KV slots, the request-table write, the ForwardBatch) and
reads the next tokens back before it can build the next one. Per batch size, after prefilling
`--context`-token prompts (in batches of up to the runner's chunked-prefill size, as a server
admits them), this runs `--steps` decode steps the way the scheduler's loop does (prepare,
forward, greedy argmax to the host, append), after WARMUP untimed ones, and reports the medians
of `prepare_decode`'s host time, of `runner.forward`'s host time and of the whole step's wall
time. A `.json` model path is a config (dummy weights); default modes (on CUDA, full decode
graphs), a decode graph captured for each `--bs` (so 512 replays a graph of its own, not one
padded to 1024).

The runner's request table holds max(--bs) requests and its KV pool every one of them at
`--context` + WARMUP + `--steps` tokens; the pool stops where the GPU's memory does, and a
start that cannot hold them all says so. Qwen3-0.6B takes 112 KiB of KV per token: 1024
requests fit an 80 GB GPU at `--context 256`, not at 512.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch

from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from common import PREFILL_CHUNK, build_runner, config_path, write_json

DEFAULT_MODEL = config_path("qwen3-0.6b")
WARMUP = 20


def time_decode_steps(runner: ModelRunner, bs: int, context: int, steps: int) -> dict[str, float]:
    """Medians of `prepare_decode` (us), of `runner.forward`'s host time (us: until the replay or
    the eager launches return) and of a whole greedy decode step (ms) for `bs` requests
    over `context`-token prompts; the requests are released after."""
    vocab = runner.config.vocab_size
    reqs = [
        Req(
            i,
            [(i * 31 + j) % (vocab - 10) + 10 for j in range(context)],
            SamplingParams(),
            0,
            WARMUP + steps + 1,
        )
        for i in range(bs)
    ]
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    group = max(1, PREFILL_CHUNK // context)  # requests per prefill batch
    with torch.inference_mode():
        tokens = []
        for start in range(0, bs, group):
            batch = prepare_extend(reqs[start : start + group], runner)
            tokens += runner.forward(batch).argmax(-1).tolist()
        prepare, forward, step = [], [], []
        for i in range(WARMUP + steps):
            for req, token in zip(reqs, tokens, strict=True):
                req.output_ids.append(token)
            sync()
            start = time.perf_counter()
            batch = prepare_decode(reqs, runner)
            prepared = time.perf_counter()
            logits = runner.forward(batch)
            launched = time.perf_counter()
            tokens = logits.argmax(-1).tolist()
            if i >= WARMUP:
                prepare.append(prepared - start)
                forward.append(launched - prepared)
                step.append(time.perf_counter() - start)
    for req in reqs:
        release(req, runner.kv)
    return {
        "prepare_us": round(statistics.median(prepare) * 1e6, 1),
        "forward_us": round(statistics.median(forward) * 1e6, 1),
        "step_ms": round(statistics.median(step) * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=str(DEFAULT_MODEL))
    parser.add_argument("--bs", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per batch")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    tokens_per_req = args.context + WARMUP + args.steps + 8
    most = max(args.bs)
    graphs = {"decode_cuda_graph_bs": sorted(set(args.bs))}
    runner = build_runner(args.model_path, args.device, most, tokens_per_req, graphs)
    if runner.kv.size < most * tokens_per_req:
        raise SystemExit(
            f"the KV cache holds {runner.kv.size} tokens, fewer than {most} requests "
            f"of {tokens_per_req} need ({most * tokens_per_req}): lower --context or --steps"
        )
    model = Path(args.model_path).stem if args.model_path.endswith(".json") else args.model_path
    rows = [
        {
            "model": model,
            "device": args.device,
            "bs": bs,
            "context": args.context,
            "steps": args.steps,
            **time_decode_steps(runner, bs, args.context, args.steps),
        }
        for bs in args.bs
    ]
    print(
        f"{'model':24s} {'bs':>4s} {'prepare_decode us':>18s} {'forward host us':>16s} "
        f"{'decode step ms':>15s}"
    )
    for r in rows:
        print(
            f"{r['model'][:24]:24s} {r['bs']:4d} {r['prepare_us']:18.1f} "
            f"{r['forward_us']:16.1f} {r['step_ms']:15.3f}"
        )
    if args.json:
        write_json(args.json, {"summary": rows})


if __name__ == "__main__":
    main()
