"""Decode milliseconds per step with the logit adjustments off and on, through the scheduler.

    python benchmark/bench_sampling.py [--model-path benchmark/configs/qwen3-0.6b.json]
        [--bs 1 64] [--context 512] [--steps 100] [--device cuda] [--json out.json]

Per batch size, two runs of `bs` requests of `--context` random prompt tokens, sampled at
temperature 0.8 with `ignore_eos`: `off` (nothing else) and `on` (presence_penalty 0.5,
frequency_penalty 0.5, repetition_penalty 1.1 and a logit_bias on LOGIT_BIAS_IDS ids, the work
of `layers/logit_adjust.py` every step). The Scheduler runs them as a server does (the overlap
schedule, default CUDA-graph modes: full decode graphs on CUDA) until every request decodes,
then 20 untimed decode steps, then `--steps` timed ones; `step_ms` is their wall time per
step (the device synchronised before and after), `overhead_ms` the `on` row's excess over
`off`. A `.json` model path is a config loaded with dummy weights.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from common import (
    SCHEDULER_WARMUP_STEPS,
    build_runner,
    config_path,
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


def time_decode(runner: ModelRunner, bs: int, context: int, steps: int, setting: str) -> float:
    """Milliseconds per decode step of `bs` requests under `setting` (see the module
    docstring)."""
    max_new = SCHEDULER_WARMUP_STEPS + steps + 8
    reqs = _requests(bs, context, max_new, runner.config.vocab_size, setting)
    return scheduler_decode_ms(runner, reqs, steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=str(DEFAULT_MODEL))
    parser.add_argument("--bs", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    tokens_per_req = args.context + SCHEDULER_WARMUP_STEPS + args.steps + 16
    runner = build_runner(args.model_path, args.device, max(args.bs), tokens_per_req)
    model = Path(args.model_path).stem if args.model_path.endswith(".json") else args.model_path
    rows = []
    for bs in args.bs:
        off = round(time_decode(runner, bs, args.context, args.steps, "off"), 4)
        on = round(time_decode(runner, bs, args.context, args.steps, "on"), 4)
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
