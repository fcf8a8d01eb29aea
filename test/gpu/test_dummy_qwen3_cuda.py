"""Dummy-loaded Qwen3-0.6B shapes on CUDA: bfloat16 logits against float32 with the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

from model_parity import rel_error

CONFIG = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-0.6b.json"


def _runner(dtype: str) -> ModelRunner:
    return ModelRunner(ServerArgs(
        model_path=str(CONFIG), load_format="dummy", device="cuda", dtype=dtype,
        max_total_tokens=2048, max_running_requests=8, context_length=1024,
    ))


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    reqs = [Req(i, list(range(100 + i, 100 + i + n)), SamplingParams(), 0, 8)
            for i, n in enumerate([5, 300, 33])]
    out = [runner.forward(prepare_extend(reqs, runner)).float()]
    for step in range(4):
        for req in reqs:
            req.output_ids.append(1000 + step)
        out.append(runner.forward(prepare_decode(reqs, runner)).float())
    for req in reqs:
        release(req, runner)
    return out


def test_bf16_matches_fp32_on_the_same_weights():
    bf16 = _runner("bfloat16")
    fp32 = _runner("float32")
    fp32.model.load_state_dict({k: v.float() for k, v in bf16.model.state_dict().items()})
    for ours, ref in zip(_logits(bf16), _logits(fp32), strict=True):
        assert torch.isfinite(ours).all()
        assert rel_error(ours, ref) < 0.02
