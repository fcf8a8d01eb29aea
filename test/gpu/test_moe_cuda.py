"""Mixtures of experts on CUDA (bfloat16): the tiny Qwen3-MoE, Qwen2-MoE and Mixtral of
test/tiny_checkpoints.py under every decode x prefill graph cell give the all-eager cell's greedy
tokens (a divergence only at a near-tie: bf16 rounding differs between batch shapes), with their
steps replayed from graphs, and so do 8 layers of Qwen3-30B-A3B's shape with dummy weights (the
kernels at a real model's sizes, the tuned table's configs); and the fused kernels equal the torch
path at that shape.
Parity with transformers in bf16: test_model_vs_hf_cuda.py (it runs the MoE families too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from replaylm.cuda_graph_modes import DISABLED
from replaylm.entrypoints.engine import Engine
from replaylm.layers.kernels.rmsnorm import rms_norm, rms_norm_of_expert_sum
from replaylm.layers.kernels.skinny_matmul import MAX_ROWS, skinny_matmul, split_k_workspace
from replaylm.layers.moe.fused_router import route_hidden_rows
from replaylm.layers.moe.fused_routing import fused_route
from replaylm.layers.moe.pair_experts import PAIR_TOKENS
from replaylm.layers.moe.routed_rows import RoutedRows
from replaylm.layers.moe.routing import select_experts
from replaylm.layers.moe.torch_experts import torch_experts
from replaylm.layers.moe.triton_experts import triton_experts
from replaylm.layers.moe.weighted_sum import weighted_sum
from replaylm.layers.quantization.fp8_kernels import rms_norm_quantize

from graph_cells import CELLS, assert_cell_matches_eager, cell_engine, greedy, random_prompts
from tiny_checkpoints import TINY_MOE_CONFIGS, write_tiny_checkpoint

pytestmark = pytest.mark.gpu

QWEN3_30B_A3B = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-30b-a3b.json"


@pytest.fixture(scope="module", params=sorted(TINY_MOE_CONFIGS))
def checkpoint(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(request.param, folder)
    return str(folder)


@pytest.fixture(scope="module")
def eager(checkpoint) -> tuple[Engine, list[list[int]], list[list[int]]]:
    """The all-eager cell's engine, the prompts and its greedy tokens."""
    engine = cell_engine(checkpoint, DISABLED, DISABLED)
    prompts = random_prompts(engine.runner.model.config.vocab_size)
    return engine, prompts, greedy(engine, prompts)


@pytest.mark.parametrize("cell", CELLS, ids="-".join)
def test_every_cell_gives_the_eager_greedy_tokens(checkpoint, eager, cell):
    assert_cell_matches_eager(*eager, checkpoint, cell)


@pytest.fixture(scope="module")
def dummy_qwen3_30b_a3b(tmp_path_factory) -> str:
    """Qwen3-30B-A3B's config cut to 8 of its 48 layers, for dummy weights."""
    config = json.loads(QWEN3_30B_A3B.read_text()) | {"num_hidden_layers": 8}
    path = tmp_path_factory.mktemp("qwen3_30b_a3b") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def dummy_eager(dummy_qwen3_30b_a3b) -> tuple[Engine, list[list[int]], list[list[int]]]:
    engine = cell_engine(dummy_qwen3_30b_a3b, DISABLED, DISABLED, load_format="dummy")
    prompts = random_prompts(engine.runner.model.config.vocab_size, count=8)
    return engine, prompts, greedy(engine, prompts)


@pytest.mark.parametrize("cell", CELLS, ids="-".join)
def test_every_cell_at_qwen3_30b_a3bs_shape(dummy_qwen3_30b_a3b, dummy_eager, cell):
    assert_cell_matches_eager(*dummy_eager, dummy_qwen3_30b_a3b, cell, load_format="dummy")


@pytest.mark.parametrize("tokens", [17, 128, 256])
def test_the_router_past_16_tokens_is_the_skinny_matmul_of_each_tile_then_the_routing(tokens):
    """Qwen3-30B-A3B's router (128 experts over hidden 2048, top 8) at a decode batch past 16
    tokens: the skinny matmul's split-K launch over every 16-token tile gives each tile's logits
    as a launch over that tile alone (bit for bit, the workspace's counters back at zero), and
    nearly every token gets the experts of cuBLAS's logits."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, 2048, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(128, 2048, generator=gen, device="cuda") * 0.02).bfloat16()
    counts = [torch.zeros(128, dtype=torch.int64, device="cuda") for _ in range(2)]
    got = route_hidden_rows(hidden, weight, 8, True, counts[0], None)
    logits = torch.cat([skinny_matmul(tile, weight) for tile in torch.split(hidden, MAX_ROWS)])
    want = fused_route(logits, 8, True, counts[1], None)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert torch.equal(counts[0], counts[1]) and int(counts[0].sum()) == tokens * 8
    assert int(split_k_workspace(hidden.device)[1].count_nonzero()) == 0
    _, cublas_ids = select_experts(torch.nn.functional.linear(hidden, weight).float(), 8, True)
    same = (got[1].sort(1).values == cublas_ids.to(got[1].dtype).sort(1).values).all(1)
    assert same.float().mean() > 0.9


@pytest.mark.parametrize("tokens", [1, 2, 8, 64, 300, 4096])
def test_fused_kernels_equal_the_torch_path_at_qwen3_30b_a3bs_shape(tokens):
    """One Qwen3-30B-A3B MoE layer (128 experts of 768 columns, top 8, hidden 2048): the pair
    route at 1 and 2 tokens, the sorted one above; there its rows before the weighted sum, summed
    in the residual-add RMSNorm's launch (and its FP8-quantizing twin's), give the summed output's
    norm bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts, hidden, inter = 128, 2048, 768

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    x = rand(tokens, hidden, scale=1.0)
    w13, w2 = rand(experts, 2 * inter, hidden, scale=0.02), rand(experts, hidden, inter, scale=0.02)
    weights, ids = select_experts(rand(tokens, experts, scale=1.0).float(), 8, True)
    ours = triton_experts(x, w13, w2, weights, ids)
    ref = torch_experts(x, w13, w2, weights, ids).float()
    assert isinstance(ours, torch.Tensor)
    assert (ours.float() - ref).norm() / ref.norm() < 1e-2
    if tokens > PAIR_TOKENS:  # the sorted route's rows, summed by the norm after the layer
        routed = triton_experts(x, w13, w2, weights, ids, defer_sum=True)
        assert isinstance(routed, RoutedRows) and torch.equal(weighted_sum(routed), ours)
        norm_weight, residual = rand(hidden, scale=1.0), rand(tokens, hidden, scale=1.0)
        got = rms_norm_of_expert_sum(*routed, norm_weight, 1e-6, residual)
        want = rms_norm(ours, norm_weight, 1e-6, residual)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        experts = (routed.weights, routed.ids, routed.num_experts)
        rows, _ = rms_norm_quantize(routed.rows, norm_weight, 1e-6, residual, experts)
        want_rows, _ = rms_norm_quantize(ours, norm_weight, 1e-6, residual)
        assert torch.equal(rows.q.view(torch.uint8), want_rows.q.view(torch.uint8))
