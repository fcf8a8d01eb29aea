"""The fused layer kernels (RMSNorm, q/k norm + rope, SiluAndMul) on the CPU, through Triton's
interpreter, against the layers' native torch code at small, odd sizes.

float32 and float16 only: the 3.6 interpreter truncates float32 -> bfloat16 casts (the GPU rounds
to nearest), so bf16 is covered on the GPU (test/gpu/test_fused_kernels.py). Then the dispatch:
`use_triton_kernels` is False on the CPU, inside `native_only()` and under torch.compile tracing;
with the kernel device pointed at the CPU, the layers and whole tiny models take the Triton route
(seen by spies) and match the native route.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

from replaylm.compilation.compile_model import (  # noqa: E402
    CompiledForward,
    TcPiecewiseOptions,
)
from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.activation import SiluAndMul  # noqa: E402
from replaylm.layers.attention.layer import attention_layers  # noqa: E402
from replaylm.layers.attention.ops import attention_context  # noqa: E402
from replaylm.layers.attention.triton.backend import TritonAttnBackend  # noqa: E402
from replaylm.layers.kernels import native_only, use_triton_kernels  # noqa: E402
from replaylm.layers.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from replaylm.layers.kernels.rmsnorm import rms_norm  # noqa: E402
from replaylm.layers.kernels.silu_mul import silu_and_mul  # noqa: E402
from replaylm.layers.kernels.skinny_matmul import (  # noqa: E402
    INVARIANT_CONFIG,
    MatmulConfig,
    fp8_rows_config,
    matmul_config,
    skinny_matmul,
)
from replaylm.layers.layernorm import RMSNorm  # noqa: E402
from replaylm.layers.linear import set_matmul  # noqa: E402
from replaylm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from replaylm.runtime.batch_ops import prepare_extend, release  # noqa: E402
from replaylm.runtime.request import Req  # noqa: E402
from replaylm.sampling_params import SamplingParams  # noqa: E402

from model_parity import (  # noqa: E402
    native_norm_rope,
    scripted_logits,
    tiny_dummy_runner,
)

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}
DTYPES = [torch.float32, torch.float16]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _norm(width: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(width, eps=1e-5).to(dtype)
    norm.weight.data = _randn(width, dtype=dtype, seed=seed)
    return norm.requires_grad_(False)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a column slice of a wider tensor (a row stride above the width)."""
    wide = torch.full((t.shape[0], t.shape[1] + 24), float("nan"), dtype=t.dtype)
    wide[:, 8 : 8 + t.shape[1]] = t
    return wide[:, 8 : 8 + t.shape[1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(5, 1000), (3, 96), (37, 128), (9, 24), (1, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_native(dtype, rows, width, with_residual):
    norm = _norm(width, dtype, seed=width)
    x = _strided(_randn(rows, width, dtype=dtype, seed=1) * 3)
    residual = _randn(rows, width, dtype=dtype, seed=2) if with_residual else None
    got = rms_norm(x, norm.weight, norm.eps, residual)
    want = norm(x, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the sum is rounded to the dtype, as torch's add
        got, want = got[0], want[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_keeps_leading_dims():
    norm = _norm(16, torch.float32, seed=0)
    x = _randn(3, 5, 16, dtype=torch.float32, seed=3)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width", "block"), [(4, 96, 1024), (3, 1000, 256), (2, 72, 32)])
def test_silu_and_mul_matches_native(dtype, rows, width, block):
    x = _strided(_randn(rows, 2 * width, dtype=dtype, seed=width) * 4)
    got = silu_and_mul(x, block=block)
    assert got.shape == (rows, width)
    torch.testing.assert_close(got, SiluAndMul()(x), **TOL[dtype])


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """q, k, v as the column slices of one fused QKV output, as the models have them."""
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=heads * dim) * 2
    return qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 32), (6, 1, 48), (3, 3, 16)])
def test_qk_norm_rope_matches_native(dtype, qk_norm, heads, kv_heads, dim):
    rotary = RotaryEmbedding(dim, 200, 10000.0, {"rope_type": "linear", "factor": 2.0})
    norms = (_norm(dim, dtype, seed=1), _norm(dim, dtype, seed=2)) if qk_norm else None
    positions = torch.tensor([7, 3, 199, 0, 3, 64])  # out of order, repeated
    q, k, _ = _qkv(len(positions), heads, kv_heads, dim, dtype)
    got = qk_norm_rope(
        q,
        k,
        positions,
        rotary.cos_cache,
        rotary.sin_cache,
        dim,
        norm=(norms[0].weight, norms[1].weight, norms[0].eps) if qk_norm else None,
        heads_per_program=2,
    )
    for ours, ref in zip(got, native_norm_rope(rotary, positions, q, k, norms), strict=True):
        assert ours.is_contiguous() and ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 32), (3, 3, 16), (8, 1, 16)])
def test_qk_norm_rope_stores_k_and_v_at_the_slots(dtype, heads, kv_heads, dim):
    """With `kv_store`, the rotated k and the given v land at each token's slot (and nowhere
    else), and q and k come out exactly as without it."""
    rotary = RotaryEmbedding(dim, 200, 10000.0)
    norms = (_norm(dim, dtype, seed=1), _norm(dim, dtype, seed=2))
    norm = (norms[0].weight, norms[1].weight, norms[0].eps)
    positions = torch.tensor([7, 3, 199, 0, 3])
    q, k, v = _qkv(len(positions), heads, kv_heads, dim, dtype)
    slots = torch.tensor([9, 2, 14, 0, 5])
    k_cache = torch.zeros(16, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    want_q, want_k = qk_norm_rope(q, k, positions, rotary.cos_cache, rotary.sin_cache, dim, norm)
    got_q, got_k = qk_norm_rope(
        q,
        k,
        positions,
        rotary.cos_cache,
        rotary.sin_cache,
        dim,
        norm,
        heads_per_program=2,
        kv_store=(v, k_cache, v_cache, slots),
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(k_cache[slots], want_k.view(-1, kv_heads, dim))
    assert torch.equal(v_cache[slots], v.reshape(-1, kv_heads, dim))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_qk_norm_rope_rejects_an_odd_head_dim():
    q, k, _ = _qkv(2, 2, 1, 15, torch.float32)
    cache = torch.zeros(8, 15)
    with pytest.raises(ValueError, match="head dim 15"):
        qk_norm_rope(q, k, torch.zeros(2, dtype=torch.long), cache, cache, 15)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias", "config"),
    [
        (1, 96, 576, False, None),  # split-K 4 with an empty last slice (576 = 4.5 blocks)
        (13, 512, 1024, True, None),
        (16, 300, 700, False, None),
        (3, 64, 1536, False, None),  # K in 6 slices of one 256-wide block each
        (5, 70, 130, True, None),  # one slice (K < 4 blocks)
        # split-K over 3 row tiles (the last ragged), each tile's slices merged apart
        (
            40,
            96,
            576,
            True,
            MatmulConfig(block_n=32, block_k=64, split_k=3, num_warps=4, num_stages=2),
        ),
        (
            7,
            90,
            200,
            True,
            MatmulConfig(block_n=64, block_k=32, split_k=3, num_warps=4, num_stages=2),
        ),
        (150, 96, 200, True, INVARIANT_CONFIG),  # 3 row tiles of 64 (--deterministic)
        (5, 90, 200, True, MatmulConfig(64, 32, 3, num_warps=4, num_stages=2, swap=True)),
    ],
)
def test_skinny_matmul_matches_linear_and_rows_do_not_depend_on_the_batch(
    dtype, rows, n, k, bias, config
):
    x = _strided(_randn(rows, k, dtype=dtype, seed=rows))
    w = _randn(n, k, dtype=dtype, seed=n) / k**0.5
    b = _randn(n, dtype=dtype, seed=1) if bias else None
    got = skinny_matmul(x, w, b, config)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), **TOL[dtype])
    for i in (0, rows - 1):  # a row alone is computed as inside the batch (bit-equal on the GPU:
        # test/gpu/test_fused_kernels.py; numpy's dots in the interpreter may round differently)
        torch.testing.assert_close(
            skinny_matmul(x[i : i + 1], w, b, config), got[i : i + 1], **TOL[dtype]
        )
    from replaylm.layers.kernels.skinny_matmul import split_k_workspace

    assert int(split_k_workspace(x.device)[1].count_nonzero()) == 0  # every counter back to zero


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "inter", "k", "bias", "config"),
    [
        (1, 40, 576, False, None),  # split-K 4: the merging slice applies SiluAndMul
        (13, 300, 200, True, None),  # one slice; a part-filled last tile of columns
        (
            40,
            48,
            1024,
            False,
            MatmulConfig(block_n=64, block_k=64, split_k=3, num_warps=4, num_stages=2),
        ),
        (
            16,
            48,
            1024,
            False,
            MatmulConfig(block_n=64, block_k=32, split_k=3, num_warps=4, num_stages=2),
        ),
        (70, 40, 96, False, INVARIANT_CONFIG),  # --deterministic's launch, 2 row tiles
        (3, 48, 1024, False, MatmulConfig(64, 32, 3, num_warps=4, num_stages=2, swap=True)),
    ],
)
def test_gated_skinny_matmul_equals_the_matmul_then_silu_and_mul(
    dtype, rows, inter, k, bias, config
):
    """`gated_silu`: one launch computing SiluAndMul of `x @ [gate; up]^T`, the numbers of the two
    launches. Bit-equal on a GPU (test/gpu/test_fused_kernels.py); here the interpreter's dots
    go through the CPU's BLAS, whose sums over tiles of other shapes may round differently."""
    x = _strided(_randn(rows, k, dtype=dtype, seed=rows))
    w = _randn(2 * inter, k, dtype=dtype, seed=inter) / k**0.5
    b = _randn(2 * inter, dtype=dtype, seed=2) if bias else None
    got = skinny_matmul(x, w, b, config, gated_silu=True)
    assert got.shape == (rows, inter) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul(skinny_matmul(x, w, b, config)))
    gate, up = torch.nn.functional.linear(x, w, b).chunk(2, dim=-1)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, **TOL[dtype])
    with pytest.raises(ValueError, match="even number of rows, not 5"):
        skinny_matmul(x, w[:5], gated_silu=True)


@pytest.mark.parametrize("config", [None, INVARIANT_CONFIG])  # split-K 4; one slice
def test_skinny_matmul_writes_float32_sums_unrounded(config):
    """`out_dtype=float32` (the LM head's logits): the kernel's float32 sums, which rounded to
    fp16 are exactly the fp16 launch's result; a gated launch refuses another dtype."""
    x = _randn(3, 576, dtype=torch.float16, seed=7)
    w = _randn(96, 576, dtype=torch.float16, seed=8) / 24
    got = skinny_matmul(x, w, config=config, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (3, 96)
    rounded = skinny_matmul(x, w, config=config)
    torch.testing.assert_close(got.half(), rounded, rtol=0, atol=0)
    assert not torch.equal(got, rounded.float())  # not a rounded result converted
    with pytest.raises(ValueError, match="gated launch writes x's dtype"):
        skinny_matmul(x, w, gated_silu=True, out_dtype=torch.float32)


def test_split_k_takes_any_tile_count_whose_partials_fit_the_workspace():
    """The split-K workspace is bounded by its partials (8 MiB) and counters (4096 tiles, of
    every row tile), not by a tile count: Llama-3.1-8B's gate_up in 4 slices (896 tiles) fits."""
    config = MatmulConfig(block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=2)
    x, w = (
        _randn(3, 64, dtype=torch.float32, seed=3),
        _randn(16 * 300, 64, dtype=torch.float32, seed=4),
    )
    torch.testing.assert_close(
        skinny_matmul(x, w, config=config),  # 300 tiles (was at most 256)
        torch.nn.functional.linear(x, w),
        **TOL[torch.float32],
    )
    wide = MatmulConfig(block_n=64, block_k=32, split_k=16, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="exceeds the workspace"):  # 200 x 16 x 16 x 64 floats
        skinny_matmul(x, _randn(64 * 200, 64, dtype=torch.float32, seed=5), config=wide)
    with pytest.raises(ValueError, match="exceeds the workspace"):  # 4097 counters
        skinny_matmul(x, _randn(16 * 4097, 64, dtype=torch.float32, seed=6), config=config)
    with pytest.raises(ValueError, match="exceeds the workspace"):  # 33 x 128 row tiles' counters
        skinny_matmul(torch.ones(2048, 64), torch.ones(33 * 16, 64), config=config)


def test_skinny_matmul_config_depends_on_the_weight_only():
    assert matmul_config(1024, 3072).split_k == 8 and matmul_config(4096, 1024).split_k == 1
    assert matmul_config(1024, 576).split_k == 4  # 4.5 blocks of K
    assert matmul_config(1024, 256).split_k == 1  # too few K blocks to split
    assert matmul_config(2048, 4096).split_k == 2  # 64 tiles: 2 slices make 128 programs
    # 1024 < K <= 2048: one 256-wide block per slice (Qwen3-0.6B's o projection)
    assert matmul_config(1024, 2048) == MatmulConfig(
        block_n=32, block_k=256, split_k=8, num_warps=4, num_stages=3
    )
    assert (matmul_config(576, 1536).block_k, matmul_config(576, 1536).split_k) == (256, 6)
    # FP8 weights wider than 4096 over K <= 4096: 64-column tiles, K unsplit (Llama-3.1-8B's qkv
    # and gate_up); of 128-511 tiles otherwise: 2 slices of 256-column blocks (its o and down)
    assert matmul_config(6144, 4096, fp8=True) == MatmulConfig(64, 256, 1, 4, 5, swap=True)
    assert matmul_config(28672, 4096, fp8=True) == MatmulConfig(64, 256, 1, 4, 5)
    assert matmul_config(4096, 4096, fp8=True) == MatmulConfig(64, 256, 4, 4, 3, swap=True)
    assert matmul_config(4096, 14336, fp8=True) == MatmulConfig(64, 256, 4, 4, 3, swap=True)
    # FP8 past 16 rows: 64-row tiles, K unsplit, columns by the width
    assert fp8_rows_config(28672) == MatmulConfig(128, 128, 1, 8, 3, block_m=64)
    assert fp8_rows_config(6144).block_n == 64 and fp8_rows_config(4096).block_n == 32


def test_use_triton_kernels_is_false_on_cpu_in_native_only_and_under_compile(monkeypatch):
    x = torch.ones(2, 4)
    assert not use_triton_kernels(x)
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    assert use_triton_kernels(x)
    with native_only():
        assert not use_triton_kernels(x)
    assert use_triton_kernels(x)

    seen: list[bool] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        seen.append(use_triton_kernels(t))
        return t * 2

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True)(x)
    with kernels.kernels_in_compiled_code():
        torch._dynamo.reset()
        torch.compile(f, backend="eager", fullgraph=True)(x)
    assert seen == [False, True]


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Point the kernel device at the CPU and count each kernel wrapper's calls (the skinny
    matmul's only where it ends in SiluAndMul: "gated_silu")."""
    from replaylm.layers.kernels import qk_norm_rope as rope_mod
    from replaylm.layers.kernels import rmsnorm as norm_mod
    from replaylm.layers.kernels import silu_mul as silu_mod
    from replaylm.layers.kernels import skinny_matmul as skinny_mod

    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    calls: dict[str, int] = {}

    def counted(name: str, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    for module, name in [
        (norm_mod, "rms_norm"),
        (rope_mod, "qk_norm_rope"),
        (silu_mod, "silu_and_mul"),
    ]:
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    gated = counted("gated_silu", skinny_matmul)
    monkeypatch.setattr(
        skinny_mod,
        "skinny_matmul",
        lambda *args, gated_silu=False, **kwargs: (gated if gated_silu else skinny_matmul)(
            *args, gated_silu=gated_silu, **kwargs
        ),
    )
    return calls


def test_lm_head_logits_are_float32_on_both_matmul_routes(kernel_calls):
    """`layers.linear.linear(..., out_dtype=float32)` (the LM head): the skinny kernel writes its
    float32 sums (rounding them gives its fp16 result), cuBLAS's route converts its fp16 result."""
    from replaylm.layers.linear import linear

    x = _randn(2, 576, dtype=torch.float16, seed=9)
    w = _randn(64, 576, dtype=torch.float16, seed=10) / 24
    sums = linear(x, w, None, "triton", out_dtype=torch.float32)
    converted = linear(x, w, None, "cublas", out_dtype=torch.float32)
    assert sums.dtype == converted.dtype == torch.float32
    torch.testing.assert_close(sums.half(), linear(x, w, None, "triton"), rtol=0, atol=0)
    torch.testing.assert_close(converted, torch.nn.functional.linear(x, w).float(), rtol=0, atol=0)
    torch.testing.assert_close(sums, converted, **TOL[torch.float16])


@pytest.mark.parametrize("matmul", ["triton", "cublas"])
def test_lm_head_writes_logits_into_the_given_buffer(kernel_calls, matmul):
    """`out=` (the decode graphs' shared logits buffer): the result lands in that buffer, equal to
    a fresh result, on both routes and through the custom-op route's `ops.linear`; a buffer of
    another dtype, shape or layout is refused."""
    from replaylm.layers.linear import linear

    x = _randn(2, 576, dtype=torch.float16, seed=11)
    w = _randn(64, 576, dtype=torch.float16, seed=12) / 24
    buffer = torch.full((4, 64), float("nan"))
    got = linear(x, w, None, matmul, out_dtype=torch.float32, out=buffer[:2])
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(
        buffer[:2], linear(x, w, None, matmul, out_dtype=torch.float32), rtol=0, atol=0
    )
    assert torch.isnan(buffer[2:]).all()
    if matmul == "triton":
        for bad in (
            torch.empty(2, 64, dtype=torch.float16),
            torch.empty(2, 63),
            torch.empty(64, 2).t(),
        ):
            with pytest.raises(ValueError, match="out must be a contiguous"):
                linear(x, w, None, matmul, out_dtype=torch.float32, out=bad)
    with pytest.raises(ValueError, match="shape"):  # never broadcast into a bigger buffer
        linear(x[:1], w, None, matmul, out_dtype=torch.float32, out=buffer[:2])


def test_layers_take_the_triton_route_and_match_native(kernel_calls):
    norm = _norm(40, torch.float32, seed=5)
    x, r = _randn(3, 40, dtype=torch.float32, seed=6), _randn(3, 40, dtype=torch.float32, seed=7)
    runs = {}
    for route in ("triton", "native"):
        with native_only() if route == "native" else contextlib.nullcontext():
            runs[route] = [norm(x), *norm(x, r), SiluAndMul()(x)]
    assert kernel_calls == {"rms_norm": 2, "silu_and_mul": 1}
    for ours, ref in zip(runs["triton"], runs["native"], strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", ["qwen3-0.6b.json", "llama-3.1-8b.json"])
def test_tiny_model_triton_route_matches_native(kernel_calls, tmp_path, config):
    """A 2-layer model of the config's architecture, shrunk, on dummy weights, in float32:
    logits of a prefill and a decode step through the kernels equal the native route's. Qwen3
    takes the fused q/k norm + rope (its per-head norms are no RMSNorm calls), Llama the same
    kernel for the rope alone (llama3 scaling)."""
    runner = tiny_dummy_runner(tmp_path, config)
    with native_only():
        want = scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=1)
    assert kernel_calls == {}
    got = scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=1)
    # 2 forwards x 2 layers; RMSNorm: 2 forwards x (2 per layer + the final norm); the gate-up
    # matmul (15 and 3 rows: the skinny kernel) with SiluAndMul in its epilogue
    assert kernel_calls == {"qk_norm_rope": 4, "rms_norm": 10, "gated_silu": 4}
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


_STORE_KV = TritonAttnBackend.store_kv


@pytest.mark.parametrize("config", ["qwen3-0.6b.json", "llama-3.1-8b.json"])
def test_the_rope_kernel_stores_kv_for_the_triton_attention_backend(
    kernel_calls, tmp_path, monkeypatch, config
):
    """With the Triton attention backend, the rope kernel stores each layer's K/V itself (no
    store_kv call); logits equal the native route's, which stores through store_kv."""
    from replaylm.layers.attention import selection

    monkeypatch.setattr(selection, "GPU_ONLY_BACKENDS", ())  # triton attention, interpreted
    stores = []
    monkeypatch.setattr(
        TritonAttnBackend, "store_kv", lambda self, *a: stores.append(1) or _STORE_KV(self, *a)
    )
    runner = tiny_dummy_runner(tmp_path, config, attention_backend="triton")
    with native_only():
        want = scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=1)
    assert len(stores) == 4  # 2 forwards x 2 layers
    with scalar_loop_bounds():
        got = scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=1)
    assert len(stores) == 4 and kernel_calls["qk_norm_rope"] == 4
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_small_batch_matmul_triton_takes_the_skinny_kernel_up_to_16_rows(
    kernel_calls, tmp_path, monkeypatch
):
    """With `--small-batch-matmul triton`, every matmul of at most 16 rows (the decode step, the
    prefill's logits) runs the skinny kernel, larger ones F.linear; logits match cuBLAS's."""
    from replaylm.layers.kernels import skinny_matmul as skinny_mod

    calls = []
    monkeypatch.setattr(
        skinny_mod,
        "skinny_matmul",
        lambda x, *a, **kw: calls.append(x.numel() // x.shape[-1]) or skinny_matmul(x, *a, **kw),
    )
    runner = tiny_dummy_runner(tmp_path, "llama-3.1-8b.json", small_batch_matmul="cublas")
    want = scripted_logits(runner, prompt_lens=(5, 30, 1), decode_steps=1)
    assert calls == [] and kernel_calls["silu_and_mul"] == 4  # 2 forwards x 2 layers
    set_matmul(runner.model, "triton")
    kernel_calls.clear()
    got = scripted_logits(runner, prompt_lens=(5, 30, 1), decode_steps=1)
    # prefill (36 tokens): only the logits (3 rows); decode: 2 layers x 4 matmuls + logits
    assert calls == [3] + [3] * 9
    assert kernel_calls["silu_and_mul"] == 2  # the prefill's: SiluAndMul after F.linear
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="must be one of cublas, triton, invariant, auto"):
        set_matmul(runner.model, "cutlass")


def test_small_batch_matmul_auto_takes_the_skinny_kernel_for_small_weights_and_the_lm_head(
    kernel_calls, tmp_path, monkeypatch
):
    """`auto` (the default): layers whose weight is at most AUTO_SKINNY_MAX_BYTES, and the LM head
    whatever its size, take the skinny kernel (up to 16 rows); larger weights F.linear. With the
    bound set between the tiny Llama's weights (fp32 bytes: o 49,152, down 61,440, qkv 98,304,
    gate_up 122,880), gate_up goes to cuBLAS; logits match cuBLAS's."""
    from replaylm.layers import linear as linear_mod
    from replaylm.layers.kernels import skinny_matmul as skinny_mod

    calls = []
    monkeypatch.setattr(
        skinny_mod,
        "skinny_matmul",
        lambda x, *a, **kw: calls.append(tuple(a[0].shape)) or skinny_matmul(x, *a, **kw),
    )
    runner = tiny_dummy_runner(tmp_path, "llama-3.1-8b.json", small_batch_matmul="cublas")
    want = scripted_logits(runner, prompt_lens=(5, 30, 1), decode_steps=1)
    monkeypatch.setattr(linear_mod, "AUTO_SKINNY_MAX_BYTES", 100_000)
    chosen = set_matmul(runner.model, "auto")
    assert chosen == {"triton": 2 * 3 + 1, "cublas": 2}  # per layer qkv, o, down; the LM head
    got = scripted_logits(runner, prompt_lens=(5, 30, 1), decode_steps=1)
    lm_head, qkv, o, down = (1024, 96), (256, 96), (96, 128), (96, 160)
    # prefill: only the logits (3 rows); decode: per layer qkv, o, down, then the logits
    assert calls == [lm_head] + [qkv, o, down] * 2 + [lm_head]
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert set_matmul(runner.model, "auto") == chosen  # the same answer on a second call
    monkeypatch.setattr(linear_mod, "AUTO_SKINNY_MAX_BYTES", 64 * 2**20)
    assert set_matmul(runner.model, "auto") == {"triton": 2 * 4 + 1}


def test_deterministic_runs_every_matmul_through_the_batch_invariant_kernel(
    kernel_calls, tmp_path, monkeypatch
):
    """`--deterministic`: all matmuls (any row count) take the skinny kernel with K unsplit, the
    attention backend is the batch-invariant one; logits match the cuBLAS route's."""
    from replaylm.layers.attention import selection
    from replaylm.layers.kernels import skinny_matmul as skinny_mod

    monkeypatch.setattr(selection, "GPU_ONLY_BACKENDS", ())  # triton attention, interpreted
    configs = []
    monkeypatch.setattr(
        skinny_mod,
        "skinny_matmul",
        lambda x, w, b=None, config=None, **kw: (
            configs.append((x.numel() // x.shape[-1], config))
            or skinny_matmul(x, w, b, config, **kw)
        ),
    )
    want = scripted_logits(
        tiny_dummy_runner(tmp_path, "qwen3-0.6b.json", small_batch_matmul="cublas"),
        prompt_lens=(5, 30, 1),
        decode_steps=1,
    )
    runner = tiny_dummy_runner(
        tmp_path, "qwen3-0.6b.json", deterministic=True, attention_backend="triton"
    )
    assert runner.attn_backend.deterministic
    with scalar_loop_bounds():
        got = scripted_logits(runner, prompt_lens=(5, 30, 1), decode_steps=1)
    # prefill: 2 layers x 4 matmuls over 36 tokens, the logits of 3; decode: all over 3 rows
    assert configs == [(36, INVARIANT_CONFIG)] * 8 + [(3, INVARIANT_CONFIG)] * 10
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_deterministic_needs_the_triton_attention_backend(tmp_path):
    with pytest.raises(ValueError, match="--deterministic needs the triton attention backend"):
        tiny_dummy_runner(tmp_path, "qwen3-0.6b.json", deterministic=True)


def _compiled_ops(compiled: CompiledForward) -> set[str]:
    """The ops the compiled forward's compute pieces call (the pieces stay FX graphs with the
    `eager` piece compiler)."""
    split = compiled.backend.split
    return {
        str(node.target)
        for piece in split.compute_pieces
        for node in getattr(split.module, piece.name).graph.nodes
        if node.op == "call_function"
    }


@pytest.mark.parametrize(
    ("compiler", "kernels", "attention"),
    [
        ("eager", "fused", "torch_native"),
        ("eager", "native", "torch_native"),
        ("inductor", "fused", "torch_native"),
        ("eager", "fused", "triton"),
        ("inductor", "fused", "triton"),
    ],
)
@torch.inference_mode()
def test_tc_piecewise_keeps_the_fused_kernels_whole(
    kernel_calls, tmp_path, monkeypatch, compiler, kernels, attention
):
    """With kernels="fused" the compiled forward calls the fused kernels as custom ops (each
    kernel launched once per layer call) and computes the eager Triton route's numbers exactly
    (Inductor too: it fuses only the glue); the q/k norm + rope op stores K/V as well: in its
    kernel with the Triton attention backend (no `store_kv` call), through `store_kv` with
    torch_native. With "native" the pieces hold the torch code instead (no kernel runs) and
    match closely."""
    from replaylm.layers.attention import selection
    from replaylm.layers.attention.torch_native import TorchNativeAttnBackend

    monkeypatch.setattr(selection, "GPU_ONLY_BACKENDS", ())  # triton attention, interpreted
    backend_cls = TritonAttnBackend if attention == "triton" else TorchNativeAttnBackend
    backend_store = backend_cls.store_kv
    stores = []
    monkeypatch.setattr(
        backend_cls, "store_kv", lambda self, *a: stores.append(1) or backend_store(self, *a)
    )
    runner = tiny_dummy_runner(tmp_path, "qwen3-0.6b.json", attention_backend=attention)
    set_matmul(runner.model, "triton")  # the skinny matmul stays whole too
    reqs = [
        Req(i, list(range(10 + i, 10 + i + n)), SamplingParams(), 0, 4)
        for i, n in enumerate((5, 3))
    ]
    batch = prepare_extend(reqs, runner)
    runner.attn_backend.init_forward_metadata(batch)
    layers = attention_layers(runner.model)
    with attention_context(batch, layers), scalar_loop_bounds():
        want = runner.model.forward_hidden(batch.input_ids, batch.positions, batch).clone()
        kernel_calls.clear()
        stores.clear()
        compiled = CompiledForward(runner.model, TcPiecewiseOptions(compiler, kernels))
        got = compiled(batch.input_ids, batch.positions)
    fused_ops = {
        "replaylm.rms_norm",
        "replaylm.add_rms_norm",
        "replaylm.rope_store_kv",
        "replaylm.linear",
    }
    ops = _compiled_ops(compiled) if compiler == "eager" else None  # Inductor's: no FX graphs
    if kernels == "fused":
        assert ops is None or (fused_ops <= ops and "replaylm.store_kv" not in ops)
        # per layer: 2 norms, q/k norm + rope, gate-up with SiluAndMul; then the final norm
        assert kernel_calls == {"rms_norm": 5, "qk_norm_rope": 2, "gated_silu": 2}
        # 2 layers; the compiled forward traces once (fake tensors: no store), then runs
        assert len(stores) == (0 if attention == "triton" else 2)
        assert torch.equal(got, want)
    else:
        assert not fused_ops & ops and kernel_calls == {} and "replaylm.store_kv" in ops
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for req in reqs:
        release(req, runner.kv)


def test_pdl_launches_wait_in_every_kernel_and_change_no_number(
    kernel_calls, tmp_path, monkeypatch
):
    """With PDL on (`set_pdl`; the capability check is bypassed: the interpreter runs the kernels'
    PDL branch, with the two grid-dependency instructions counted instead of executed), a tiny
    Qwen3 on the triton attention and matmul kernels computes bit-equal logits, and every kernel
    program waits for its producers: the kernels are launched with `launch_pdl`."""
    import triton.language.extra.cuda as tl_cuda

    from replaylm.layers.attention import selection

    monkeypatch.setattr(selection, "GPU_ONLY_BACKENDS", ())  # triton attention, interpreted
    waits = {"gdc_wait": 0, "gdc_launch_dependents": 0}

    def counted(name: str):
        def instruction():
            waits[name] += 1

        return instruction

    for name in waits:
        monkeypatch.setattr(tl_cuda, name, counted(name))
    runner = tiny_dummy_runner(
        tmp_path, "qwen3-0.6b.json", attention_backend="triton", small_batch_matmul="triton"
    )
    with scalar_loop_bounds():
        want = scripted_logits(runner, prompt_lens=(5, 12, 1), decode_steps=1)
        assert waits == {"gdc_wait": 0, "gdc_launch_dependents": 0}
        kernels.set_pdl(True)
        try:
            assert kernels.pdl_launch() == {"USE_PDL": True, "launch_pdl": True}
            got = scripted_logits(runner, prompt_lens=(5, 12, 1), decode_steps=1)
        finally:
            kernels.set_pdl(False)
    assert waits["gdc_wait"] > 0 and waits["gdc_wait"] == waits["gdc_launch_dependents"]
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_enable_pdl_is_refused_off_hopper(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"--enable-pdl needs a CUDA GPU of compute capability "
        r"9\.0\+, not cpu",
    ):
        tiny_dummy_runner(tmp_path, "qwen3-0.6b.json", enable_pdl=True)


def test_pdl_is_on_by_default_only_where_supported(tmp_path):
    assert kernels.choose_pdl(None, True) == (True, "default: a GPU of compute capability 9.0+")
    assert kernels.choose_pdl(None, False) == (
        False,
        "default: needs a CUDA GPU of compute capability 9.0+",
    )
    assert kernels.choose_pdl(True, True) == (True, "--enable-pdl")
    assert kernels.choose_pdl(False, True) == (False, "--no-enable-pdl")
    tiny_dummy_runner(tmp_path, "qwen3-0.6b.json")  # the default on a CPU: off
    assert kernels.pdl_launch() == {"USE_PDL": False}
