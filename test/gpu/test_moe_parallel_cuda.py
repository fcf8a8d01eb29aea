"""Mixtures of experts over two GPUs (NCCL, one GPU per rank): the tiny Qwen3-MoE, Qwen2-MoE and
Mixtral of test/tiny_checkpoints.py with their experts' columns split (`tp_size` 2) or their
experts placed whole (`--enable-expert-parallel`) give one GPU's greedy tokens, in float32 so
that the all-reduce's other summation order cannot flip a token but at a tie (a divergence only
where one GPU's top-2 logits are within float32 noise), under the default graph modes and
tc_piecewise. The sums go by NCCL: an Engine's process meets peers over peer memory once
(test_tensor_parallel_cuda.py's one-shot cases keep that for themselves). Skipped on a machine
with one GPU."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from replaylm.entrypoints.engine import Engine

from graph_cells import random_prompts
from model_parity import divergence_gaps
from tiny_checkpoints import TINY_MOE_CONFIGS, write_tiny_checkpoint

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="MoE parallelism on CUDA needs 2 GPUs"),
]

MODES = [
    {"decode": "full", "prefill": "breakable"},
    {"decode": "tc_piecewise", "prefill": "tc_piecewise"},
]
FP32_TIE = 1e-2  # a top-2 gap this small is a tie at float32 noise
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module", params=sorted(TINY_MOE_CONFIGS))
def checkpoint(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(request.param, folder)
    return str(folder)


def _engine(path: str, modes: dict[str, str], **parallel: object) -> Engine:
    return Engine(
        model_path=path,
        device="cuda",
        dtype="float32",
        max_total_tokens=8192,
        max_running_requests=32,
        cuda_graph_mode=json.dumps(modes),
        tp_all_reduce="nccl",
        **parallel,
    )


@pytest.mark.parametrize("modes", MODES, ids=lambda m: f"{m['decode']}-{m['prefill']}")
def test_two_gpus_give_one_gpus_greedy_tokens(checkpoint: str, modes: dict[str, str]) -> None:
    one = _engine(checkpoint, modes)
    prompts = random_prompts(one.runner.model.config.vocab_size)
    want = [o["output_ids"] for o in one.generate(input_ids=prompts, sampling_params=GREEDY)]
    try:
        for parallel in ({"tp_size": 2}, {"tp_size": 2, "enable_expert_parallel": True}):
            engine = _engine(checkpoint, modes, **parallel)
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            got = [o["output_ids"] for o in outs]
            stats = engine.runner.forward_stats.phases
            assert stats["decode"].graph > 0 and stats["prefill"].graph > 0
            engine.shutdown()
            del engine
            gc.collect()
            gaps = divergence_gaps(one.runner, prompts, got, want)
            assert all(gap <= FP32_TIE for gap in gaps.values()), (parallel, gaps)
    finally:
        one.shutdown()
        del one
        gc.collect()
        torch.cuda.empty_cache()
