"""The Triton KV stores and attention kernels over an fp8 KV cache (`--kv-cache-dtype
fp8_e4m3`), through Triton's interpreter: the stores write the torch pool's bytes exactly, and
decode, extend and the backend's whole step equal torch_native over the same fp8 cache (the
same stored values and scales: only the order of float32 sums differs). Then a tiny model's
Triton route (the rope kernel storing K/V, the attention kernels) against torch_native's, both
over fp8 caches with non-unit scales.

The interpreter's own float32 -> e4m3 rounding drops the carry into the exponent (126.1 comes
out 64, not 128) where the GPU rounds in hardware, so these tests give it torch's rounding
(`torch_e4m3_rounding`); test/gpu/test_fp8_kv_cache_cuda.py runs the kernels compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.attention.layer import attention_layers  # noqa: E402
from replaylm.layers.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from replaylm.layers.attention.triton import TritonAttnBackend  # noqa: E402
from replaylm.layers.attention.triton.common import KernelConfig  # noqa: E402
from replaylm.layers.attention.triton.kv_store import store_kv  # noqa: E402
from replaylm.layers.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from replaylm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from replaylm.mem_cache.kv_pool import KVPool  # noqa: E402
from replaylm.model_executor.forward_batch import ForwardMode  # noqa: E402

from attention_cases import (  # noqa: E402
    Case,
    make_case,
    rel_error,
    store_and_attend,
    triton_decode,
    triton_extend,
)
from model_parity import scripted_logits, tiny_dummy_runner  # noqa: E402

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.03, 0.02  # the cases' random K and V (std 1) stay inside +-448
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
SMALL_TILES = KernelConfig(block_n=16, num_warps=4, num_stages=1, block_m=32)
DECODE_TILES = KernelConfig(block_n=16, num_warps=4, num_stages=1)


@contextlib.contextmanager
def torch_e4m3_rounding() -> Iterator[None]:
    """Inside, the interpreter converts float32 and float16 to e4m3 as torch does (round to
    nearest even, as the GPU's conversion); other conversions as before."""
    original = interpreter._convert_float

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16):
            e4m3 = torch.from_numpy(values.astype(np.float32)).to(FP8)
            return e4m3.view(torch.uint8).numpy()
        return original(values, input_dtype, output_dtype, rounding_mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_convert_float", convert)
        yield


@pytest.fixture(autouse=True, scope="module")
def _interpreter_as_the_gpu():
    with scalar_loop_bounds(), torch_e4m3_rounding():
        yield


def _fp8_case(mode: ForwardMode, prefix: list[int], extend: list[int], *shape, **kw) -> Case:
    """`make_case`'s case (float32 or float16 q) over an fp8 pool holding its random K/V with
    the layer's scales, K_SCALE and V_SCALE."""
    case = make_case(mode, prefix, extend, *shape, "cpu", **kw)
    src = case.batch.kv.pool
    pool = KVPool(src.size, 1, src.num_kv_heads, src.head_dim, FP8, "cpu")
    every = torch.arange(src.size + 1)
    pool.store(0, every, src.k_buffers[0], src.v_buffers[0], K_SCALE, V_SCALE)
    case.layer.k_scale, case.layer.v_scale = K_SCALE, V_SCALE
    batch = dataclasses.replace(case.batch, kv=dataclasses.replace(case.batch.kv, pool=pool))
    return dataclasses.replace(case, batch=batch)


def _native(case: Case) -> torch.Tensor:
    """torch_native's float32 output over the case's fp8 pool (its new K/V stored already)."""
    native = TorchNativeAttnBackend()
    batch = dataclasses.replace(case.batch, attn_backend=native)
    native.init_forward_metadata(batch)
    q = case.q.float()
    return native.forward(q, case.k.float(), case.v.float(), case.layer, batch, torch.empty_like(q))


def _store(case: Case) -> None:
    """The new tokens' K/V into the pool through the Triton store."""
    b = case.batch
    pool = b.kv.pool
    store_kv(
        pool.k_buffers[0], pool.v_buffers[0], b.out_cache_loc, case.k, case.v, K_SCALE, V_SCALE
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_store_kernel_writes_the_torch_pools_bytes(dtype):
    """Strided k and v, values past 448 * scale saturating: the same e4m3 bytes as
    `KVPool.store`, only at the given slots."""
    gen = torch.Generator().manual_seed(1)
    qkv = (torch.randn(5, 6, 16, generator=gen) * 8).to(dtype)
    k, v = qkv[:, 2:4], qkv[:, 4:6]  # views of a fused QKV output, as models give them
    k[0, 0, 0], v[1, 1, 3] = 300.0, -300.0  # past 448 * K_SCALE, 448 * V_SCALE
    loc = torch.tensor([7, 1, 12, 3, 19])
    triton_pool, torch_pool = (KVPool(20, 1, 2, 16, FP8, "cpu") for _ in range(2))
    store_kv(triton_pool.k_buffers[0], triton_pool.v_buffers[0], loc, k, v, K_SCALE, V_SCALE)
    torch_pool.store(0, loc, k, v, K_SCALE, V_SCALE)
    for ours, ref in zip(
        triton_pool.k_buffers + triton_pool.v_buffers,
        torch_pool.k_buffers + torch_pool.v_buffers,
        strict=True,
    ):
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    assert triton_pool.k_buffers[0][7, 0, 0].float() == 448.0
    assert triton_pool.v_buffers[0][1, 1, 3].float() == -448.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_rope_kernel_stores_as_the_store_kernel(dtype):
    """The rope kernel's K/V store into fp8 caches writes what the store kernel writes for the
    k it returns and the v it was given."""
    heads, kv_heads, dim = 4, 2, 32
    rotary = RotaryEmbedding(dim, 200, 10000.0)
    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([7, 3, 199, 0, 3])
    q = torch.randn(5, heads * dim, generator=gen).to(dtype)
    k = (torch.randn(5, kv_heads * dim, generator=gen) * 8).to(dtype)
    v = (torch.randn(5, kv_heads * dim, generator=gen) * 8).to(dtype)
    slots = torch.tensor([9, 2, 14, 1, 5])
    fused = [torch.zeros(16, kv_heads, dim, dtype=FP8) for _ in range(2)]
    _, k_out = qk_norm_rope(
        q,
        k,
        positions,
        rotary.cos_cache,
        rotary.sin_cache,
        dim,
        heads_per_program=2,
        kv_store=(v, *fused, slots),
        kv_scales=(K_SCALE, V_SCALE),
    )
    want = [torch.zeros(16, kv_heads, dim, dtype=FP8) for _ in range(2)]
    store_kv(*want, slots, k_out.view(5, kv_heads, dim), v.view(5, kv_heads, dim), K_SCALE, V_SCALE)
    for ours, ref in zip(fused, want, strict=True):
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    assert fused[0].float().abs().max() == 448.0  # some saturated: the scale was applied


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "splits"), [(4, 2, 4), (8, 1, 3), (4, 4, 1)])
def test_decode_over_an_fp8_cache_equals_torch_native(dtype, separate, heads, kv_heads, splits):
    case = _fp8_case(
        ForwardMode.DECODE, [0, 16, 99, 250], [1] * 4, heads, kv_heads, 16, dtype, seed=heads
    )
    _store(case)
    out = torch.full_like(case.q, float("nan"))
    triton_decode(
        case,
        out,
        splits,
        min_split_len=16,
        config=DECODE_TILES,
        separate_merge=separate,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert rel_error(out, _native(case)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("prefix", "extend", "heads", "kv_heads"),
    [([0], [70], 2, 2), ([0, 40, 3], [33, 1, 50], 4, 2), ([90, 0], [17, 64], 8, 2)],
)
def test_extend_over_an_fp8_cache_equals_torch_native(dtype, prefix, extend, heads, kv_heads):
    """The new tokens attend to their K/V as stored (rounded to e4m3), as torch_native does."""
    case = _fp8_case(
        ForwardMode.EXTEND, prefix, extend, heads, kv_heads, 16, dtype, seed=sum(extend)
    )
    _store(case)
    out = triton_extend(case, config=SMALL_TILES, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_error(out, _native(case)) < TOL[dtype]


@pytest.mark.parametrize("num_decode", [0, 2, 4])
def test_the_triton_backend_stores_and_attends_as_torch_native(num_decode):
    """A whole step of each backend over its own copy of the same fp8 pool, with the layer's
    scales: prefill, mixed and decode batches; equal stores, equal outputs."""
    extend = [1, 1, 17, 5] if num_decode < 4 else [1] * 4
    mode = ForwardMode.DECODE if num_decode == 4 else ForwardMode.EXTEND
    outs, pools = [], []
    for backend in (TritonAttnBackend(), TorchNativeAttnBackend()):
        case = _fp8_case(mode, [12, 70, 0, 33], extend, 4, 2, 32, torch.float32, seed=11)
        batch = dataclasses.replace(case.batch, attn_backend=backend, num_decode=num_decode % 4)
        backend.init_forward_metadata(batch)
        outs.append(store_and_attend(backend, case.q, case.k, case.v, case.layer, batch))
        pools.append(batch.kv.pool)
    assert rel_error(outs[0], outs[1]) < TOL[torch.float32]
    triton_pool, native_pool = pools
    for ours, ref in zip(
        triton_pool.k_buffers + triton_pool.v_buffers,
        native_pool.k_buffers + native_pool.v_buffers,
        strict=True,
    ):
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("config", ["qwen3-0.6b.json", "llama-3.1-8b.json"])
def test_a_tiny_models_triton_route_equals_torch_native_over_fp8_caches(
    tmp_path, monkeypatch, config
):
    """Logits of a prefill and decode steps: the rope kernel storing K/V into the fp8 cache and
    the Triton attention kernels, against the torch_native backend's store and attention (its
    rope through the same kernel), both with non-unit scales on every layer."""
    from replaylm.layers.attention import selection

    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")  # the layers' Triton route
    monkeypatch.setattr(selection, "GPU_ONLY_BACKENDS", ())  # triton attention, interpreted
    logits = []
    for backend in ("triton", "torch_native"):
        (tmp_path / backend).mkdir()
        runner = tiny_dummy_runner(
            tmp_path / backend, config, attention_backend=backend, kv_cache_dtype="fp8_e4m3"
        )
        assert runner.kv.pool.dtype == FP8
        for i, layer in enumerate(attention_layers(runner.model)):
            layer.k_scale, layer.v_scale = 0.05 * (i + 1), 0.02 * (i + 1)
        logits.append(scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=2))
    for ours, ref in zip(*logits, strict=True):
        assert rel_error(ours, ref) < 1e-4
