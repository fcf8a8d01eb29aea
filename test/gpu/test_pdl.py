"""`--enable-pdl` on the H100: the Triton kernels launched with programmatic dependent launch
compute the numbers they compute without it, bit for bit, eagerly and replayed from CUDA graphs
(every mode), and a server-shaped Engine generates the same tokens.

A kernel that read its producer's output before `wait_for_producers` would race: these tests
compare exactly, over many launches, so such a race shows as differing logits."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from replaylm.cuda_graph_modes import DISABLED, mode_cells
from replaylm.entrypoints.engine import Engine
from replaylm.layers.kernels import pdl_launch

from model_parity import dummy_runner, scripted_logits

QWEN3 = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-0.6b.json"
MODES = [(DISABLED, DISABLED), *mode_cells()]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a GPU of compute capability 9.0+",
    ),
]


def _logits(
    enable_pdl: bool, decode: str, prefill: str, matmul: str = "triton"
) -> tuple[list[torch.Tensor], dict]:
    """A dummy Qwen3-0.6B's scripted logits in these modes, and its graph-served forwards."""
    runner = dummy_runner(
        QWEN3,
        "cuda",
        "bfloat16",
        attention_backend="triton",
        small_batch_matmul=matmul,
        enable_pdl=enable_pdl,
        cuda_graph_mode=json.dumps({"decode": decode, "prefill": prefill}),
    )
    assert pdl_launch()["USE_PDL"] is enable_pdl
    logits = scripted_logits(runner, prompt_lens=(5, 300, 33, 1), decode_steps=6)
    graphed = {phase: stats.graph for phase, stats in runner.forward_stats.phases.items()}
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return logits, graphed


@pytest.mark.parametrize(("decode", "prefill"), MODES, ids=[f"{d}-{p}" for d, p in MODES])
def test_pdl_logits_equal_plain_launches(decode, prefill):
    want, _ = _logits(False, decode, prefill)
    got, graphed = _logits(True, decode, prefill)
    if decode != "disabled":
        assert graphed["decode"] > 0 and graphed["prefill"] > 0
    for ours, ref in zip(got, want, strict=True):
        assert torch.equal(ours, ref)


def test_pdl_logits_equal_plain_launches_between_cublas_matmuls():
    """PDL is on by default also where cuBLAS kernels (launched without it) sit between ours."""
    want, _ = _logits(False, "full", "breakable", matmul="cublas")
    got, _ = _logits(True, "full", "breakable", matmul="cublas")
    for ours, ref in zip(got, want, strict=True):
        assert torch.equal(ours, ref)


def test_engine_with_pdl_generates_the_same_tokens():
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    prompts = [[100 + i + j for j in range(5 + 7 * i)] for i in range(12)]
    outputs = {}
    for pdl in (False, True):
        engine = Engine(
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=20000,
            small_batch_matmul="triton",
            enable_pdl=pdl,
        )
        outputs[pdl] = [
            o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)
        ]
        del engine
        gc.collect()
    assert outputs[True] == outputs[False]
