"""Decode milliseconds per step with the logit adjustments off and on, through the scheduler.

    python benchmark/bench_sampling.py [--model-path benchmark/configs/qwen3-0.6b.json]
        [--bs 1 64] [--context 512] [--steps 100] [--device cuda] [--sampler] [--json out.json]

Per batch size, two runs of `bs` requests of `--context` random prompt tokens, sampled at
temperature 0.8 with `ignore_eos`: `off` (nothing else) and `on` (presence_penalty 0.5,
frequency_penalty 0.5, repetition_penalty 1.1 and a logit_bias on LOGIT_BIAS_IDS ids, the work
of `layers/logit_adjust.py` every step). The Scheduler runs them as a server does (the overlap
schedule, default CUDA-graph modes: full decode graphs on CUDA) until every request decodes,
then 20 untimed decode steps, then `--steps` timed ones; `step_ms` is their wall time per
step (the device synchronised before and after), `overhead_ms` the `on` row's excess over
`off`. A `.json` model path is a config loaded with dummy weights.

`--sampler`: instead, the Sampler alone on `bs` rows of random float32 logits over the model's
vocabulary at temperature 0.8 (no top-k, top-p or min-p), microseconds per call by CUDA events
over back-to-back calls: its one-pass kernel (`layers/kernels/seeded_sample.py`) against its
torch code (`native_only()`), which draws the same tokens.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import torch

from replaylm.layers.kernels import native_only
from replaylm.layers.sampler import Sampler, SamplingBatchInfo
from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams

from common import (
    SCHEDULER_WARMUP_STEPS,
    bench_scheduler,
    build_runner,
    config_path,
    cuda_time_ms,
    scheduler_decode_ms,
    write_json,
)

DEFAULT_MODEL = config_path("qwen3-0.6b")
LOGIT_BIAS_IDS = 8
SETTINGS: dict[str, dict[str, Any]] = {
    "off": {},
    "on": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
}


def _requests(bs: int, context: int, max_new: int, vocab: int, setting: str) -> list[Req]:
    rng = random.Random(bs)
    extra = dict(SETTINGS[setting])
    if setting == "on":
        extra["logit_bias"] = {rng.randrange(vocab): 1.0 for _ in range(LOGIT_BIAS_IDS)}
    params = SamplingParams(max_new_tokens=max_new, temperature=0.8, ignore_eos=True, **extra)
    return [
        Req(str(i), [rng.randrange(vocab) for _ in range(context)], params, i, max_new)
        for i in range(bs)
    ]


def time_decode(sched: Scheduler, bs: int, context: int, steps: int, setting: str) -> float:
    """Milliseconds per decode step of `bs` requests under `setting` (see the module
    docstring)."""
    max_new = SCHEDULER_WARMUP_STEPS + steps + 8
    reqs = _requests(bs, context, max_new, sched.runner.config.vocab_size, setting)
    return scheduler_decode_ms(sched, reqs, steps)


def time_sampler(vocab: int, bs: int, device: str) -> dict[str, float]:
    """Microseconds per Sampler call on `bs` rows of `vocab` logits, per route (see the module
    docstring)."""
    params = [SamplingParams(temperature=0.8)] * bs
    info = SamplingBatchInfo.from_params(params, list(range(bs)), vocab, device)
    gen = torch.Generator(device=device).manual_seed(bs)
    logits = torch.randn(bs, vocab, device=device, generator=gen) * 4
    steps = torch.arange(bs, device=device)
    sampler = Sampler()
    one_pass = cuda_time_ms(lambda: sampler(logits, info, steps), calls=10)
    with native_only():
        torch_code = cuda_time_ms(lambda: sampler(logits, info, steps), calls=10)
    return {"one_pass_us": round(one_pass * 1e3, 1), "torch_code_us": round(torch_code * 1e3, 1)}


def sampler_rows(model_path: str, bs_list: list[int], device: str) -> list[dict[str, Any]]:
    """`--sampler`'s rows, printed."""
    from replaylm.model_loader.loader import load_model_config

    vocab = load_model_config(model_path).vocab_size
    model = Path(model_path).stem
    rows = [
        {"name": f"sampler_bs{bs}", "model": model, "bs": bs, "vocab": vocab}
        | time_sampler(vocab, bs, device)
        for bs in bs_list
    ]
    print(f"{'model':24s} {'bs':>4s} {'one pass us':>12s} {'torch code us':>14s}")
    for r in rows:
        print(f"{model[:24]:24s} {r['bs']:4d} {r['one_pass_us']:12.1f} {r['torch_code_us']:14.1f}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=str(DEFAULT_MODEL))
    parser.add_argument("--bs", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sampler", action="store_true", help="the Sampler alone, per route")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.sampler:
        rows = sampler_rows(args.model_path, args.bs, args.device)
        if args.json:
            write_json(args.json, {"summary": rows})
        return

    tokens_per_req = args.context + SCHEDULER_WARMUP_STEPS + args.steps + 16
    sched = bench_scheduler(
        build_runner(args.model_path, args.device, max(args.bs), tokens_per_req)
    )
    model = Path(args.model_path).stem if args.model_path.endswith(".json") else args.model_path
    rows = []
    for bs in args.bs:
        off = round(time_decode(sched, bs, args.context, args.steps, "off"), 4)
        on = round(time_decode(sched, bs, args.context, args.steps, "on"), 4)
        for setting, ms in (("off", off), ("on", on)):
            rows.append(
                {
                    "name": f"sampling_bs{bs}_{setting}",
                    "model": model,
                    "device": args.device,
                    "bs": bs,
                    "penalties": setting,
                    "context": args.context,
                    "steps": args.steps,
                    "step_ms": ms,
                    "overhead_ms": round(ms - off, 4),
                }
            )
    print(f"{'model':24s} {'bs':>4s} {'penalties':>9s} {'step ms':>9s} {'overhead ms':>12s}")
    for r in rows:
        print(
            f"{r['model'][:24]:24s} {r['bs']:4d} {r['penalties']:>9s} {r['step_ms']:9.3f} "
            f"{r['overhead_ms']:12.3f}"
        )
    if args.json:
        write_json(args.json, {"summary": rows})


if __name__ == "__main__":
    main()
