"""Tensor parallelism on several GPUs (NCCL, one GPU per rank): Qwen3-0.6B's shapes with dummy
weights (16 heads and 8 KV heads divide by 2 and 4), under the three graph-mode pairs.

- Logits of TP=2 and TP=4 (where the machine has 4 GPUs) equal TP=1's within bfloat16 noise, on
  a ragged prefill and decode steps that run the captured graphs, all-reduces inside them.
- Greedy generations of an Engine with `tp_size` 2 and 4 equal TP=1's. In float32, so that the
  all-reduce's other summation order cannot flip a token: a divergence is allowed only where
  TP=1's top-2 logits tie within float32 noise.

Skipped on a machine with one GPU.
"""

from __future__ import annotations

import functools
import gc
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from replaylm.entrypoints.engine import Engine
from replaylm.server_args import ServerArgs

from model_parity import divergence_gaps, rel_error
from tp_ranks import run_ranks, runner_logits

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="tensor parallelism on CUDA needs 2 GPUs"),
]

CONFIG = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-0.6b.json"
TP_SIZES = [n for n in (2, 4) if n <= GPUS]
MODES = [
    {"decode": "full", "prefill": "breakable"},
    {"decode": "breakable", "prefill": "breakable"},
    {"decode": "tc_piecewise", "prefill": "tc_piecewise"},
]
REL_TOL = 2e-2  # bfloat16 logits, as test_dummy_qwen3_cuda.py holds bf16 to fp32
FP32_TIE = 1e-2  # a top-2 gap this small is a tie at float32 noise (typical gaps: ~0.1)

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 150000) for _ in range(_rng.randrange(4, 300))] for _ in range(32)]
GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}


def _args(modes: dict[str, str], dtype: str, tp_size: int = 1) -> ServerArgs:
    return ServerArgs(
        model_path=str(CONFIG),
        load_format="dummy",
        device="cuda",
        dtype=dtype,
        tp_size=tp_size,
        cuda_graph_mode=json.dumps(modes),
        decode_cuda_graph_bs=[1, 2, 4, 8, 16, 32],
        prefill_cuda_graph_tokens=[64, 128, 256, 512],
        chunked_prefill_size=512,
        max_total_tokens=16384,
        max_running_requests=32,
        context_length=1024,
    )


def _name(modes: dict[str, str]) -> str:
    return f"{modes['decode']}-{modes['prefill']}"


def _generate(args: ServerArgs) -> tuple[Engine, list[list[int]]]:
    engine = Engine(**vars(args))
    out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    stats = engine.runner.forward_stats.phases
    assert stats["prefill"].graph > 0 and stats["decode"].graph > 0
    return engine, [o["output_ids"] for o in out]


@pytest.mark.parametrize("modes", MODES, ids=_name)
def test_greedy_generations_match_one_rank(modes):
    one_rank, want = _generate(_args(modes, "float32"))
    try:
        for tp_size in TP_SIZES:
            engine, got = _generate(_args(modes, "float32", tp_size))
            engine.shutdown()
            del engine
            gc.collect()
            gaps = divergence_gaps(one_rank.runner, PROMPTS, got, want)
            print(f"{_name(modes)} TP={tp_size}: {len(gaps)} of {len(PROMPTS)} diverge: {gaps}")
            assert all(gap <= FP32_TIE for gap in gaps.values()), gaps
    finally:
        del one_rank
        gc.collect()
        torch.cuda.empty_cache()


@functools.cache
def _one_rank_logits(modes: str) -> list[np.ndarray]:
    return run_ranks(runner_logits, _args(json.loads(modes), "bfloat16"))


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("modes", MODES, ids=_name)
def test_logits_match_one_rank(modes, tp_size):
    ref = _one_rank_logits(json.dumps(modes))
    ours = run_ranks(runner_logits, _args(modes, "bfloat16", tp_size))
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        err = rel_error(torch.from_numpy(a), torch.from_numpy(b))
        print(f"{_name(modes)} TP={tp_size} step {step}: relative error {err:.2e}")
        assert err < REL_TOL, step
