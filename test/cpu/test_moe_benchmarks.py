"""The mixture-of-experts benchmarks' arithmetic: bench_one_batch's decode floor (the dense
weights, the experts a step reaches, their expected count under uniform routing, and the batch's
KV) and bench_moe_kernel's layer shapes, floor bytes and grouped-GEMM baseline."""

from __future__ import annotations

import pytest
import torch

from replaylm.layers.moe.layer import FusedMoE
from replaylm.layers.moe.routing import select_experts
from replaylm.layers.moe.torch_experts import torch_experts

from model_parity import make_runner
from script_import import import_script
from tiny_checkpoints import write_tiny_checkpoint


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_a_step_reads_the_experts_its_routing_reaches(tmp_path):
    write_tiny_checkpoint("qwen3_moe", tmp_path)
    runner = make_runner(str(tmp_path), "cpu", "float32")
    bench = import_script("benchmark/bench_one_batch.py")
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    experts = sum(_bytes(m.parameters()) for m in moes)
    dense = _bytes(runner.model.parameters()) - experts
    no_kv = bench.decode_bytes(runner, 1, 0)
    assert no_kv == dense + round(experts * 2 / 8)  # one token: its top 2 of 8 experts per layer
    many = bench.decode_bytes(runner, 1000, 0)
    assert many == pytest.approx(dense + experts, rel=1e-6)  # a large batch reaches them all
    assert bench.decode_bytes(runner, 4, 16) > bench.decode_bytes(runner, 4, 0)


def test_the_kernel_benchmark_reads_the_layer_shape_and_counts_the_reached_experts():
    bench = import_script("benchmark/bench_moe_kernel.py")
    assert bench.layer_shape("qwen3-30b-a3b") == (128, 2048, 768, 8, True)
    assert bench.layer_shape("mixtral-8x7b") == (8, 4096, 14336, 2, True)
    with pytest.raises(ValueError, match="not a mixture of experts"):
        bench.layer_shape("qwen3-0.6b")
    ids = torch.tensor([[0, 5], [5, 7]])  # 3 experts reached by 2 tokens, top 2
    hidden, inter = 16, 8
    expected = 2 * (3 * 3 * hidden * inter + 2 * hidden * 2 + 2 * 2 * (inter + hidden))
    assert bench.floor_bytes(ids, hidden, inter, tokens=2, top_k=2) == expected


def test_the_grouped_mm_baseline_is_the_torch_experts():
    """The kernel benchmark's `torch._grouped_mm` route gives `torch_experts`' output, empty
    experts and all (CPU: torch's own grouped GEMM, 16-byte aligned rows)."""
    bench = import_script("benchmark/bench_moe_kernel.py")
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, top_k = 8, 64, 32, 12, 2
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 8).bfloat16()
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 3] = -1e9  # expert 3 gets no token
    weights, ids = select_experts(logits, top_k, True)
    want = torch_experts(x, w13, w2, weights, ids)
    got = bench.grouped_mm_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
