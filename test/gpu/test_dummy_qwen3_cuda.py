"""Dummy-loaded Qwen3-0.6B shapes on CUDA: bfloat16 logits against float32 with the same weights;
the prefill chunk such a model takes by default on this GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replaylm.model_executor.prefill_chunk import (
    LARGE_GPU_BYTES,
    LARGE_GPU_PREFILL_CHUNK,
    default_prefill_chunk,
)
from replaylm.server_args import DEFAULT_PREFILL_CHUNK

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


def test_a_dense_model_on_a_large_gpu_prefills_chunks_of_8192():
    """Without --chunked-prefill-size a dense model on a GPU of 35 GiB or more takes chunks of
    8,192 tokens (docs/tuning.md, "Prefill chunks"), elsewhere 2,048."""
    runner = dummy_runner(CONFIG, "cuda", "bfloat16")
    total = torch.cuda.get_device_properties(runner.device).total_memory
    large = (LARGE_GPU_PREFILL_CHUNK, f"a GPU of {total / 2**30:.0f} GiB")
    assert default_prefill_chunk(runner.model) == (
        large if total >= LARGE_GPU_BYTES else (DEFAULT_PREFILL_CHUNK, "the default")
    )
