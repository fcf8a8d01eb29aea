"""`--attention-backend flashinfer` on CUDA against triton, bfloat16 (skipped without the
flashinfer-python package).

Dummy Qwen3-0.6B (16 heads, 8 KV heads: decode off tensor cores) and a Llama-3.1-8B-shaped model
cut to 4 layers (32 heads, 8 KV heads: decode on tensor cores): logits of a prefill of fresh
prompts (FlashInfer's ragged kernel, replayed through a breakable prefill graph with padding
requests), a chunk over a cached prefix (the paged kernel) and decode steps (a `full` graph per
batch size, planned again before each replay) agree with triton's by norm, under every decode
mode; a mixed step (decode tokens riding with a prefill chunk: the paged kernel); and with each
backend serving one phase (`--prefill-attention-backend`), over one KV pool.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from model_parity import chunked_then_decode_logits, dummy_runner, rel_error

pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
pytestmark = pytest.mark.gpu

CONFIGS = Path(__file__).resolve().parents[2] / "benchmark" / "configs"
DECODE_STEPS = 6  # chunked_then_decode_logits' decode steps


@pytest.fixture(autouse=True)
def _release_runners():
    """A runner's graphs and KV pool stay in the allocator's cache until collected: a dozen
    runners in one process would not fit otherwise."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _runner(config: Path, **args) -> ModelRunner:
    base = {
        "max_total_tokens": 8192,
        "max_running_requests": 8,
        "context_length": 4096,
        "decode_cuda_graph_bs": [1, 2, 4, 8],
    }
    return dummy_runner(config, "cuda", "bfloat16", **{**base, **args})


@pytest.fixture(scope="module", params=["qwen3-0.6b", "llama-3.1-8b"])
def config(request, tmp_path_factory) -> Path:
    """The config file: Llama-3.1-8B's cut to 4 layers (its attention shapes are what matter)."""
    path = CONFIGS / f"{request.param}.json"
    if request.param == "qwen3-0.6b":
        return path
    cfg = json.loads(path.read_text())
    cfg["num_hidden_layers"] = 4
    out = tmp_path_factory.mktemp("llama") / "config.json"
    out.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def triton_logits(config) -> tuple[dict, list[torch.Tensor]]:
    runner = _runner(config, attention_backend="triton")
    with torch.inference_mode():
        return runner.model.state_dict(), chunked_then_decode_logits(runner)


def _agree(runner: ModelRunner, reference: tuple[dict, list[torch.Tensor]]) -> list[float]:
    weights, want = reference
    runner.model.load_state_dict(weights)
    with torch.inference_mode():
        got = chunked_then_decode_logits(runner)
    errors = [rel_error(a, b) for a, b in zip(got, want, strict=True)]
    print("relative errors per step:", [f"{e:.1e}" for e in errors])
    assert all(torch.isfinite(a).all() for a in got)
    assert max(errors) < 2e-2  # two bf16 kernels: triton against torch_native is ~1.3e-2
    return errors


@pytest.mark.parametrize("decode_mode", ["full", "breakable", "disabled"])
def test_flashinfer_logits_agree_with_triton(config, triton_logits, decode_mode):
    runner = _runner(
        config,
        attention_backend="flashinfer",
        cuda_graph_mode=json.dumps({"decode": decode_mode, "prefill": "breakable"}),
    )
    assert runner.attn_backend.name == "flashinfer"
    _agree(runner, triton_logits)
    stats = runner.forward_stats.phases
    assert stats["decode"].graph == (0 if decode_mode == "disabled" else DECODE_STEPS)
    assert stats["prefill"].graph >= 1  # the fresh prompts' step, replayed with padding


@pytest.mark.parametrize(
    ("decode", "prefill"), [("flashinfer", "triton"), ("triton", "flashinfer")]
)
def test_one_backend_per_phase_agrees_with_triton(config, triton_logits, decode, prefill):
    runner = _runner(config, attention_backend=decode, prefill_attention_backend=prefill)
    assert runner.attn_backend.name == "per_phase"
    _agree(runner, triton_logits)
    assert runner.forward_stats.phases["decode"].graph == DECODE_STEPS


def _mixed_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Two prompts prefilled, then one step of their decode tokens with a third prompt's."""
    running = [
        Req(i, [(13 * i + 7 * j) % 30000 + 10 for j in range(n)], SamplingParams(), 0, 8)
        for i, n in enumerate([40, 700])
    ]
    fresh = Req(2, [(5 * j) % 30000 + 10 for j in range(300)], SamplingParams(), 0, 8)
    with torch.inference_mode():
        out = [runner.forward(prepare_extend(running, runner)).float()]
        for req in running:
            req.output_ids.append(1234)
        out.append(runner.forward(prepare_extend([fresh], runner, decoding=running)).float())
    for req in [*running, fresh]:
        release(req, runner.kv)
    return out


def test_mixed_steps_agree_with_triton(config):
    triton = _runner(config, attention_backend="triton")
    flashinfer = _runner(config, attention_backend="flashinfer")
    flashinfer.model.load_state_dict(triton.model.state_dict())
    want, got = _mixed_logits(triton), _mixed_logits(flashinfer)
    assert got[1].shape[0] == 3  # two decode rows and the prompt's
    errors = [rel_error(a, b) for a, b in zip(got, want, strict=True)]
    print("relative errors per step:", [f"{e:.1e}" for e in errors])
    assert max(errors) < 2e-2
