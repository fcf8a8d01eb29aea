"""FP8 weights on CUDA: the FP8 GEMMs against the float reference, each FP8 checkpoint layout's
logits on the GPU against the CPU's emulation of the same rounding, and every decode x prefill
graph cell of an FP8 model against its own eager cell. (Perplexity and top-1 agreement of the
built-in model with `--quantization fp8` against the unquantized one:
test/cpu/test_fp8_smollm2.py, whose emulation rounds as these kernels do.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replaylm.cuda_graph_modes import DISABLED
from replaylm.entrypoints.engine import Engine
from replaylm.layers.kernels.rmsnorm import rms_norm
from replaylm.layers.quantization import fp8
from replaylm.layers.quantization.fp8 import FP8_DTYPE, quantize_weight
from replaylm.layers.quantization.fp8_kernels import (
    SPLIT_ROWS,
    quantize_activation,
    rms_norm_quantize,
)
from replaylm.layers.quantization.fp8_linear import _emulated, fp8_linear
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from graph_cells import CELLS, assert_cell_matches_eager, cell_engine, greedy, random_prompts
from model_parity import make_runner, rel_error
from tiny_checkpoints import write_fp8_checkpoint, write_tiny_checkpoint

pytestmark = pytest.mark.gpu

# bf16 activations on the GPU against float32 on the CPU: each bf16 rounding that moves an input
# element across an e4m3 rounding boundary moves it by a whole e4m3 step, on these tiny random
# models a tenth of the logits' norm in all
CHECKPOINT_TOLERANCE = 0.2


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_fp8_matmul_matches_the_float_reference(rows: int, block: tuple[int, int] | None) -> None:
    """Llama-3.1-8B's down projection shape (K 14336 -> N 4096), one bias, bf16 out: every
    path (the skinny kernel at decode rows of per-channel weights, cuBLASLt, the block GEMM)
    against the emulation of its quantized input."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    n, k = 4096, 14336
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    weight, scale = quantize_weight(torch.randn(n, k, generator=gen, device="cuda") * 0.02, block)
    bias = torch.randn(n, generator=gen, device="cuda").bfloat16()
    got = fp8_linear(x, weight, scale, block, bias=bias)
    want = _emulated(x, weight, scale, block, None) + bias.float()
    assert got.dtype == torch.bfloat16
    assert rel_error(got, want) < 1e-2


@pytest.mark.parametrize("width", [2048, 4096, 14336])
@pytest.mark.parametrize("rows", [1, SPLIT_ROWS, SPLIT_ROWS + 1, 300])
def test_fp8_norm_is_the_norm_then_the_quantization_on_cuda(rows: int, width: int) -> None:
    """The FP8-quantizing residual-add RMSNorm (at decode rows a program a piece of the row)
    and the quantization alone (the same) give the norm's launch then the quantization's
    numbers bit for bit on the GPU: the new residual, the e4m3 values and the scales."""
    gen = torch.Generator(device="cuda").manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen, device="cuda").bfloat16()
    residual = torch.randn(rows, width, generator=gen, device="cuda").bfloat16()
    weight = (torch.rand(width, generator=gen, device="cuda") + 0.5).bfloat16()
    got, new_residual = rms_norm_quantize(x, weight, 1e-6, residual)
    normed, want_residual = rms_norm(x, weight, 1e-6, residual)
    want_q, want_scale = quantize_activation(normed)
    assert new_residual is not None and torch.equal(new_residual, want_residual)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale, want_scale)
    # and the torch code's on the CPU (correctly rounded divisions there too)
    q_cpu, scale_cpu = fp8.quantize_activation(normed.cpu())
    assert torch.equal(got.scale.cpu(), scale_cpu)
    assert torch.equal(got.q.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


def _last_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits after each prompt, one prefill batch."""
    reqs = [Req(str(i), p, SamplingParams(), 0, 1) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        logits = runner.forward(prepare_extend(reqs, runner)).float().cpu()
    for req in reqs:
        release(req, runner.kv)
    return logits


@pytest.mark.parametrize(
    ("kind", "layout", "block"),
    [
        ("llama3_blocks", "fp8_block", None),
        ("llama3", "fp8_tensor_static", None),
        ("qwen2", "ct_channel", None),
        ("qwen3", "ct_tensor_static", None),
        ("qwen3_moe", "fp8_block", [32, 32]),
        ("qwen3_moe", "ct_channel", None),
    ],
)
def test_checkpoint_on_cuda_matches_the_cpu_emulation(
    tmp_path: Path, kind: str, layout: str, block: list[int] | None
) -> None:
    write_fp8_checkpoint(kind, tmp_path, layout, block)
    prompts = random_prompts(320, count=8)
    cuda = make_runner(str(tmp_path), "cuda", "bfloat16")
    assert cuda.model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    got = _last_logits(cuda, prompts)
    want = _last_logits(make_runner(str(tmp_path), "cpu", "float32"), prompts)
    assert rel_error(got, want) < CHECKPOINT_TOLERANCE
    top2 = want.topk(2, dim=-1).values
    decisive = top2[:, 0] - top2[:, 1] > 1.0  # the random tiny models' near-ties may flip
    assert (got.argmax(-1) == want.argmax(-1))[decisive].all()


@pytest.fixture(scope="module", params=["llama3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(request.param, folder)
    return str(folder)


@pytest.fixture(scope="module")
def eager(checkpoint) -> tuple[Engine, list[list[int]], list[list[int]]]:
    engine = cell_engine(checkpoint, DISABLED, DISABLED, quantization="fp8")
    prompts = random_prompts(engine.runner.model.config.vocab_size)
    return engine, prompts, greedy(engine, prompts)


@pytest.mark.parametrize("cell", CELLS, ids="-".join)
def test_every_cell_gives_the_fp8_eager_greedy_tokens(checkpoint, eager, cell):
    assert_cell_matches_eager(*eager, checkpoint, cell, quantization="fp8")


def test_deterministic_refuses_fp8_weights_in_one_line(tmp_path: Path) -> None:
    write_tiny_checkpoint("llama3", tmp_path)
    with pytest.raises(ValueError, match=r"^--deterministic does not cover FP8 weights: "):
        Engine(model_path=str(tmp_path), device="cuda", quantization="fp8", deterministic=True)
