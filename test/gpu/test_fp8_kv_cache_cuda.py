"""`--kv-cache-dtype fp8_e4m3` on CUDA (bfloat16 models): the Triton kernels compiled over an
fp8 cache (the store's hardware rounding against torch's, decode and extend against
torch_native over the same cache), then tiny checkpoints carrying KV-cache scales under every
decode x prefill CUDA-graph cell, each giving the fp8 cache's all-eager cell's greedy tokens (a
divergence only at a near-tie: bf16 rounding differs between batch shapes). The scales are
fixed floats, so a captured graph holds them as the eager launches do.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replaylm.cuda_graph_modes import DISABLED, modes_serving
from replaylm.entrypoints.engine import Engine
from replaylm.layers.attention.layer import attention_layers
from replaylm.layers.attention.torch_native import TorchNativeAttnBackend
from replaylm.layers.attention.triton.kv_store import store_kv
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.model_executor.forward_batch import ForwardMode

from attention_cases import Case, make_case, rel_error, triton_decode, triton_extend
from model_parity import divergence_gaps
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.03, 0.02  # random K and V (std 1) stay inside +-448
BF16_TOL = 1e-2  # relative error by norm against torch_native over the same cache (bf16 q)
NEAR_TIE = 0.5
PROMPTS = 24
CELLS = [
    (decode, prefill)
    for decode in (*modes_serving("decode"), DISABLED)
    for prefill in (*modes_serving("prefill"), DISABLED)
]


def _fp8_case(mode: ForwardMode, prefix: list[int], extend: list[int], heads: int) -> Case:
    """A bf16 case over an fp8 pool holding its random K/V with scales K_SCALE, V_SCALE, its
    new tokens' K/V stored by the Triton store."""
    case = make_case(mode, prefix, extend, heads, 2, 128, torch.bfloat16, "cuda", seed=heads)
    src = case.batch.kv.pool
    pool = KVPool(src.size, 1, 2, 128, FP8, "cuda")
    every = torch.arange(src.size + 1, device="cuda")
    pool.store(0, every, src.k_buffers[0], src.v_buffers[0], K_SCALE, V_SCALE)
    case.layer.k_scale, case.layer.v_scale = K_SCALE, V_SCALE
    b = dataclasses.replace(case.batch, kv=dataclasses.replace(case.batch.kv, pool=pool))
    store_kv(
        pool.k_buffers[0], pool.v_buffers[0], b.out_cache_loc, case.k, case.v, K_SCALE, V_SCALE
    )
    return dataclasses.replace(case, batch=b)


def _native(case: Case) -> torch.Tensor:
    """torch_native's float32 output over the case's fp8 pool."""
    native = TorchNativeAttnBackend()
    batch = dataclasses.replace(case.batch, attn_backend=native)
    native.init_forward_metadata(batch)
    q = case.q.float()
    return native.forward(q, case.k.float(), case.v.float(), case.layer, batch, torch.empty_like(q))


def test_the_store_kernel_rounds_as_torch():
    """The hardware's e4m3 rounding and saturation against torch's: the same bytes but for a
    rare neighbouring code (the divisions may round their last float32 bit apart)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(4096, 12, 128, generator=gen, device="cuda").bfloat16() * 8
    k, v = qkv[:, 4:8], qkv[:, 8:12]
    loc = torch.randperm(8192, generator=gen, device="cuda")[:4096] + 1
    ours, ref = (KVPool(8192, 1, 4, 128, FP8, "cuda") for _ in range(2))
    store_kv(ours.k_buffers[0], ours.v_buffers[0], loc, k, v, K_SCALE, V_SCALE)
    ref.store(0, loc, k, v, K_SCALE, V_SCALE)
    for a, b in zip(ours.k_buffers + ours.v_buffers, ref.k_buffers + ref.v_buffers, strict=True):
        diff = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
        assert diff.max() <= 1 and diff.bool().float().mean() < 1e-3
        assert a.float().abs().max() == 448.0  # values past 448 * scale saturate


@pytest.mark.parametrize("heads", [2, 8, 16])
def test_decode_over_an_fp8_cache_matches_torch_native(heads):
    ctx = [1, 77, 600, 1500, 4097]
    case = _fp8_case(ForwardMode.DECODE, [c - 1 for c in ctx], [1] * len(ctx), heads)
    for splits in (1, 4):
        for separate in (False, True):
            out = torch.full_like(case.q, float("nan"))
            triton_decode(
                case, out, splits, separate_merge=separate, k_scale=K_SCALE, v_scale=V_SCALE
            )
            assert rel_error(out, _native(case)) < BF16_TOL


@pytest.mark.parametrize("heads", [2, 8])
def test_extend_over_an_fp8_cache_matches_torch_native(heads):
    prefix, extend = [0, 300, 17, 1000], [513, 1, 64, 200]
    case = _fp8_case(ForwardMode.EXTEND, prefix, extend, heads)
    out = triton_extend(case, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_error(out, _native(case)) < BF16_TOL


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def checkpoint(request, tmp_path_factory) -> str:
    """A tiny checkpoint whose layers carry KV-cache scales (`self_attn.k_scale`, ...)."""
    folder: Path = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(request.param, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01 * (i + 2))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def _engine(path: str, decode: str, prefill: str) -> Engine:
    return Engine(
        model_path=path,
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype="fp8_e4m3",
        max_total_tokens=8192,
        max_running_requests=32,
        cuda_graph_mode=json.dumps({"decode": decode, "prefill": prefill}),
    )


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def eager(checkpoint) -> tuple[Engine, list[list[int]], list[list[int]]]:
    """The fp8 cache's all-eager cell: its engine, the prompts and its greedy tokens."""
    engine = _engine(checkpoint, DISABLED, DISABLED)
    layers = attention_layers(engine.runner.model)
    assert engine.runner.kv.pool.dtype == FP8
    scales = [s for a in layers for s in (a.k_scale, a.v_scale)]
    assert scales == pytest.approx([0.02, 0.02, 0.04, 0.03])  # the checkpoint's
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.model.config.vocab_size
    prompts = [
        torch.randint(0, vocab, (5 + 7 * i % 40,), generator=gen).tolist() for i in range(PROMPTS)
    ]
    return engine, prompts, _greedy(engine, prompts)


@pytest.mark.parametrize(("decode", "prefill"), CELLS)
def test_every_cell_gives_the_eager_fp8_caches_greedy_tokens(checkpoint, eager, decode, prefill):
    reference, prompts, want = eager
    engine = _engine(checkpoint, decode, prefill)
    try:
        got = _greedy(engine, prompts)
        phases = engine.runner.forward_stats.phases
        if decode != DISABLED:
            assert phases["decode"].graph > 0
        if prefill != DISABLED:
            assert phases["prefill"].graph > 0
    finally:
        engine.shutdown()
    gaps = divergence_gaps(reference.runner, prompts, got, want)
    assert all(gap <= NEAR_TIE for gap in gaps.values()), gaps
    assert len(gaps) <= 1, gaps
