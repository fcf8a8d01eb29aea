"""Dummy-loaded Qwen3-0.6B shapes on CUDA: bfloat16 logits against float32 with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_parity import dummy_runner, rel_error, scripted_logits

pytestmark = pytest.mark.gpu

CONFIG = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-0.6b.json"


def test_bf16_matches_fp32_on_the_same_weights():
    bf16 = dummy_runner(CONFIG, "cuda", "bfloat16")
    fp32 = dummy_runner(CONFIG, "cuda", "float32")
    fp32.model.load_state_dict({k: v.float() for k, v in bf16.model.state_dict().items()})
    for ours, ref in zip(scripted_logits(bf16), scripted_logits(fp32), strict=True):
        assert torch.isfinite(ours).all()
        assert rel_error(ours, ref) < 0.02
