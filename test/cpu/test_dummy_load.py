"""--load-format dummy with a real architecture's config (Qwen3-0.6B shapes)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

CONFIG = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-0.6b.json"
QWEN3_06B_PARAMS = 596_049_920  # the published checkpoint's parameter count (tied embeddings)


def test_dummy_qwen3_06b_builds_runs_and_has_the_real_parameter_count():
    runner = load_model_runner(
        resolve_engine_config(
            ServerArgs(
                model_path=str(CONFIG),
                load_format="dummy",
                device="cpu",
                max_total_tokens=64,
                max_running_requests=2,
                context_length=64,
            )
        )
    )
    n_params = sum(p.numel() for p in runner.model.parameters())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG))
    assert n_params == sum(p.numel() for p in hf.parameters()) == QWEN3_06B_PARAMS

    reqs = [Req(0, list(range(10, 30)), SamplingParams(), 0, 4)]
    logits = runner.forward(prepare_extend(reqs, runner))
    assert logits.shape == (1, 151936)
    assert torch.isfinite(logits).all() and logits.std() > 0
    reqs[0].output_ids.append(int(logits.argmax()))
    assert torch.isfinite(runner.forward(prepare_decode(reqs, runner))).all()
