"""Fused layer kernels (RMSNorm, q/k norm + rope, SiluAndMul, the skinny matmul) on CUDA against the
layers' native torch code (`native_only()`, F.linear), at Qwen3-0.6B and Llama-3.1-8B shapes,
bfloat16 and float32; the skinny matmul's rows bit-equal whatever the batch's size.

Relative error by norm: under 1e-2 for bf16 (the kernels round rope once where torch rounds each
product and the sum), 1e-5 for fp32; residual sums bit-equal. Then the kernels captured in a CUDA
graph and replayed on new inputs equal eager, bit for bit, and a dummy-weight Qwen3-0.6B's logits
through the kernels (eager and from CUDA graphs) agree with the native route. Last, the sampler's
noise kernel is bit-equal to its torch code, so the Sampler picks the same tokens on both routes.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from replaylm.layers.activation import SiluAndMul
from replaylm.layers.kernels import native_only, use_triton_kernels
from replaylm.layers.kernels.qk_norm_rope import qk_norm_rope
from replaylm.layers.kernels.skinny_matmul import (
    INVARIANT_CONFIG,
    MAX_ROWS,
    MatmulConfig,
    skinny_matmul,
    split_k_workspace,
)
from replaylm.layers.layernorm import RMSNorm
from replaylm.layers.rotary_embedding import RotaryEmbedding

from model_parity import dummy_runner, native_norm_rope, rel_error, scripted_logits

pytestmark = pytest.mark.gpu

QWEN3 = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-0.6b.json"
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 7, 64, 2048]


class Shape(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    max_positions: int
    rope_theta: float
    rope_scaling: dict | None
    qk_norm: bool


SHAPES = {
    "qwen3-0.6b": Shape(1024, 16, 8, 128, 3072, 1e-6, 40960, 1e6, None, True),
    "llama-3.1-8b": Shape(
        4096,
        32,
        8,
        128,
        14336,
        1e-5,
        131072,
        5e5,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        False,
    ),
}


@pytest.fixture(autouse=True)
def _triton_route_without_grad():
    assert use_triton_kernels(torch.empty(1, device="cuda")), "the Triton route is not taken"
    with torch.no_grad():
        yield


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def _norm(width: int, eps: float, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(width, eps).to("cuda", dtype)
    norm.weight.copy_(_randn(width, dtype=dtype, seed=seed, scale=0.3) + 1)
    return norm


def _check(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert torch.isfinite(ours).all()
    err = rel_error(ours, ref)
    print(f"rel error {err:.2e}")
    assert err < TOL[dtype]


def _native(fn, *args):
    with native_only():
        return fn(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("model", SHAPES)
def test_rms_norm(model, tokens, dtype):
    shape = SHAPES[model]
    norm = _norm(shape.hidden, shape.eps, dtype, seed=1)
    x = _randn(tokens, shape.hidden, dtype=dtype, seed=2, scale=4)
    residual = _randn(tokens, shape.hidden, dtype=dtype, seed=3)
    _check(norm(x), _native(norm, x), dtype)
    (out, res), (ref_out, ref_res) = norm(x, residual), _native(norm, x, residual)
    assert torch.equal(res, ref_res)
    _check(out, ref_out, dtype)
    head_norm = _norm(shape.head_dim, shape.eps, dtype, seed=4)  # rows of 128, several a program
    heads = _randn(tokens, shape.heads, shape.head_dim, dtype=dtype, seed=5, scale=4)
    _check(head_norm(heads), _native(head_norm, heads), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("model", SHAPES)
def test_silu_and_mul(model, tokens, dtype):
    x = _randn(tokens, 2 * SHAPES[model].intermediate, dtype=dtype, seed=5, scale=3)
    act = SiluAndMul()
    _check(act(x), _native(act, x), dtype)


def _attention_inputs(shape: Shape, tokens: int, dtype: torch.dtype):
    """(rotary, positions, q, k, norms): q and k column slices of one QKV output."""
    rotary = RotaryEmbedding(
        shape.head_dim, shape.max_positions, shape.rope_theta, shape.rope_scaling
    ).to("cuda")
    positions = torch.randint(
        0,
        shape.max_positions,
        (tokens,),
        device="cuda",
        generator=torch.Generator(device="cuda").manual_seed(tokens),
    )
    qkv = _randn(
        tokens, (shape.heads + 2 * shape.kv_heads) * shape.head_dim, dtype=dtype, seed=6, scale=2
    )
    q, k, _ = qkv.split(
        [
            shape.heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        ],
        dim=-1,
    )
    norms = None
    if shape.qk_norm:
        norms = (
            _norm(shape.head_dim, shape.eps, dtype, 7),
            _norm(shape.head_dim, shape.eps, dtype, 8),
        )
    return rotary, positions, q, k, norms


def _fused(rotary, positions, q, k, norms):
    weights = None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)
    return qk_norm_rope(
        q, k, positions, rotary.cos_cache, rotary.sin_cache, rotary.head_dim, weights
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("model", SHAPES)
def test_qk_norm_rope(model, tokens, dtype):
    inputs = _attention_inputs(SHAPES[model], tokens, dtype)
    for ours, ref in zip(_fused(*inputs), native_norm_rope(*inputs), strict=True):
        assert ours.is_contiguous()
        _check(ours, ref, dtype)
    rotary, positions, q, k, _ = inputs  # rope alone (Llama), checked against the module
    for ours, ref in zip(
        _fused(rotary, positions, q, k, None), _native(rotary, positions, q, k), strict=True
    ):
        _check(ours, ref, dtype)


@pytest.mark.parametrize("model", SHAPES)
def test_qk_norm_rope_stores_k_and_v_at_the_slots(model):
    """The kernel's K/V store (the decode step's, in place of store_kv) on the GPU."""
    shape, tokens = SHAPES[model], 7
    rotary, positions, q, k, norms = _attention_inputs(shape, tokens, torch.bfloat16)
    v = _randn(tokens, shape.kv_heads * shape.head_dim, dtype=torch.bfloat16, seed=12)
    k_cache = torch.zeros(64, shape.kv_heads, shape.head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64, device="cuda")[:tokens]
    weights = None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)
    want_q, want_k = _fused(rotary, positions, q, k, norms)
    got_q, got_k = qk_norm_rope(
        q,
        k,
        positions,
        rotary.cos_cache,
        rotary.sin_cache,
        rotary.head_dim,
        weights,
        kv_store=(v, k_cache, v_cache, slots),
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(k_cache[slots], want_k.view(tokens, shape.kv_heads, shape.head_dim))
    assert torch.equal(v_cache[slots], v.view(tokens, shape.kv_heads, shape.head_dim))
    assert int((k_cache != 0).any(-1).any(-1).sum()) <= tokens  # nothing beside the slots


@pytest.mark.parametrize("tokens", [1, 7])
def test_cuda_graph_replay_equals_eager(tokens):
    shape, dtype = SHAPES["qwen3-0.6b"], torch.bfloat16
    rotary, positions, q, k, norms = _attention_inputs(shape, tokens, dtype)
    norm, act = _norm(shape.hidden, shape.eps, dtype, seed=9), SiluAndMul()
    static = {
        "x": _randn(tokens, shape.hidden, dtype=dtype, seed=10),
        "residual": _randn(tokens, shape.hidden, dtype=dtype, seed=11),
        "gate_up": _randn(tokens, 2 * shape.intermediate, dtype=dtype, seed=12),
        "positions": positions,
        "q": q,
        "k": k,
    }

    def step() -> list[torch.Tensor]:
        return [
            *norm(static["x"], static["residual"]),
            act(static["gate_up"]),
            *_fused(rotary, static["positions"], static["q"], static["k"], norms),
        ]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for seed in (20, 30):
        for i, (name, t) in enumerate(static.items()):
            fresh = (
                torch.randint_like(t, 0, shape.max_positions)
                if name == "positions"
                else _randn(*t.shape, dtype=dtype, seed=seed + i)
            )
            t.copy_(fresh)
        graph.replay()
        for replayed, eager in zip(outputs, step(), strict=True):
            assert torch.equal(replayed, eager)


# (N, K): Qwen3-0.6B's qkv, o, gate_up, down; SmolLM2-135M's qkv, o, down, LM head
MATMUL_SHAPES = [
    (4096, 1024),
    (1024, 2048),
    (6144, 1024),
    (1024, 3072),
    (960, 576),
    (576, 576),
    (576, 1536),
    (49152, 576),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), MATMUL_SHAPES)
def test_skinny_matmul_matches_linear_and_rows_are_batch_invariant(n, k, dtype):
    w = _randn(n, k, dtype=dtype, seed=n) / k**0.5
    x = _randn(MAX_ROWS, k, dtype=dtype, seed=k)
    full = skinny_matmul(x, w)
    _check(full, torch.nn.functional.linear(x, w), dtype)
    for rows in range(1, MAX_ROWS + 1):
        assert torch.equal(skinny_matmul(x[:rows], w), full[:rows])
    assert int(split_k_workspace(x.device)[1].count_nonzero()) == 0


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("rows", [17, 128, 200])
def test_split_k_over_several_row_tiles_gives_each_tile_alone(rows, swap):
    """A split-K launch over several row tiles (Qwen3-30B-A3B's o, 2048 x 4096, bf16) merges
    each tile's slices apart: every row tile equals the same launch over its rows alone, bit
    for bit, and the counters end at zero."""
    config = MatmulConfig(64, 128, 2, num_warps=4, num_stages=4, block_m=64, swap=swap)
    w = _randn(2048, 4096, dtype=torch.bfloat16, seed=rows) / 64
    x = _randn(rows, 4096, dtype=torch.bfloat16, seed=rows + 1)
    full = skinny_matmul(x, w, config=config)
    _check(full, torch.nn.functional.linear(x, w), torch.bfloat16)
    for start in range(0, rows, 64):
        tile = x[start : start + 64]
        assert torch.equal(skinny_matmul(tile, w, config=config), full[start : start + 64])
    assert int(split_k_workspace(x.device)[1].count_nonzero()) == 0


# (2 x intermediate, hidden): Qwen3-0.6B's and SmolLM2-135M's gate_up (one slice each)
@pytest.mark.parametrize(("n", "k"), [(6144, 1024), (3072, 576)])
@pytest.mark.parametrize("config", [None, INVARIANT_CONFIG])
def test_gated_skinny_matmul_is_bit_equal_to_matmul_then_silu_and_mul(n, k, config):
    """The gate-up matmul with SiluAndMul in its epilogue (bf16): every row bit-equal to the
    matmul followed by the SiluAndMul kernel, and rows still batch-invariant."""
    from replaylm.layers.kernels.silu_mul import silu_and_mul

    w = _randn(n, k, dtype=torch.bfloat16, seed=n) / k**0.5
    x = _randn(MAX_ROWS, k, dtype=torch.bfloat16, seed=k)
    full = skinny_matmul(x, w, None, config, gated_silu=True)
    assert torch.equal(full, silu_and_mul(skinny_matmul(x, w, None, config)))
    for rows in (1, 3, 8):
        assert torch.equal(skinny_matmul(x[:rows], w, None, config, gated_silu=True), full[:rows])


@pytest.mark.parametrize(("n", "k"), MATMUL_SHAPES[:4])
def test_invariant_matmul_rows_do_not_depend_on_the_row_count(n, k):
    """`--deterministic`'s matmul: any row count, each row bit-equal to the same row computed in
    a batch of another size (1, 3, 16, 64, 65, 300 and 1000 rows)."""
    w = _randn(n, k, dtype=torch.bfloat16, seed=n) / k**0.5
    x = _randn(1000, k, dtype=torch.bfloat16, seed=k)
    full = skinny_matmul(x, w, None, INVARIANT_CONFIG)
    _check(full, torch.nn.functional.linear(x, w), torch.bfloat16)
    for rows in (1, 3, 16, 64, 65, 300):
        assert torch.equal(skinny_matmul(x[-rows:], w, None, INVARIANT_CONFIG), full[-rows:])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("split_k", [1, 2])
def test_swapped_skinny_matmul_equals_the_unswapped_one(split_k, gated):
    """The dot taken as W @ X^T (`MatmulConfig.swap`), with PDL's early weight load on sm90+:
    the same sums as the usual orientation, split or not, gated or not."""
    n, k = 6144, 1024  # Qwen3-0.6B's gate_up
    w = _randn(n, k, dtype=torch.bfloat16, seed=n) / k**0.5
    x = _randn(5, k, dtype=torch.bfloat16, seed=k)
    plain = MatmulConfig(64, 128, split_k, num_warps=4, num_stages=3)
    swapped = MatmulConfig(64, 128, split_k, num_warps=4, num_stages=3, swap=True)
    out = torch.bfloat16 if gated else torch.float32  # a gated launch writes x's dtype
    want = skinny_matmul(x, w, None, plain, gated_silu=gated, out_dtype=out)
    got = skinny_matmul(x, w, None, swapped, gated_silu=gated, out_dtype=out)
    torch.testing.assert_close(got, want, rtol=1e-2 if gated else 1e-5, atol=1e-5)


def test_skinny_matmul_in_a_cuda_graph_equals_eager():
    w1 = _randn(1024, 2048, dtype=torch.bfloat16, seed=1) / 45  # split-K
    w2 = _randn(4096, 1024, dtype=torch.bfloat16, seed=2) / 32  # one slice
    x = _randn(3, 2048, dtype=torch.bfloat16, seed=3)

    def step() -> torch.Tensor:
        return skinny_matmul(skinny_matmul(x, w1), w2)

    step()  # compiles the kernel and allocates the workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (4, 5):
        x.copy_(_randn(*x.shape, dtype=x.dtype, seed=seed))
        graph.replay()
        assert torch.equal(out, step())


@pytest.mark.parametrize("matmul", ["cublas", "triton"])
@pytest.mark.parametrize(("dtype", "tol"), [("bfloat16", 2e-2), ("float32", 1e-4)])
def test_dummy_qwen3_logits_triton_vs_native(dtype, tol, matmul):
    eager = dummy_runner(
        QWEN3,
        "cuda",
        dtype,
        decode_disable_cuda_graph=True,
        prefill_disable_cuda_graph=True,
        small_batch_matmul=matmul,
    )
    with native_only():
        want = scripted_logits(eager)
    runs = {"eager": scripted_logits(eager)}
    if dtype == "bfloat16":  # the kernels inside the default CUDA graphs too
        graphed = dummy_runner(QWEN3, "cuda", dtype, small_batch_matmul=matmul)
        graphed.model.load_state_dict(eager.model.state_dict())
        runs["graphed"] = scripted_logits(graphed)
        assert graphed.forward_stats.phases["decode"].graph > 0
    for name, got in runs.items():
        errors = [rel_error(a, b) for a, b in zip(got, want, strict=True)]
        print(f"{name}: relative errors per step:", [f"{e:.1e}" for e in errors])
        assert all(torch.isfinite(a).all() for a in got)
        assert max(errors) < tol


@pytest.mark.parametrize("rows", [1, 37, 256])
def test_sampler_kernel_is_bit_equal_to_the_torch_code(rows):
    from replaylm.layers.kernels.seeded_sample import seeded_sample
    from replaylm.layers.sampler import seeded_uniform

    gen = torch.Generator(device="cuda").manual_seed(rows)
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
    steps = torch.randint(0, 4096, (rows,), device="cuda", generator=gen)
    temperatures = torch.rand(rows, device="cuda", generator=gen) * 1.5 + 0.05
    vocab = 151936  # Qwen3's
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 4
    got = seeded_sample(logits, temperatures, seeds, steps)
    noise = seeded_uniform(seeds, steps, torch.arange(vocab, device="cuda"))
    want = (logits / temperatures.unsqueeze(1) - torch.log(-torch.log(noise))).argmax(-1)
    assert torch.equal(got, want)


def test_sampler_kernel_route_picks_the_torch_routes_tokens():
    from replaylm.layers.sampler import Sampler, SamplingBatchInfo
    from replaylm.sampling_params import SamplingParams

    params = [SamplingParams(temperature=t) for t in (0.0, 0.6, 1.0, 1.5)] * 4
    info = SamplingBatchInfo.from_params(params, list(range(16)), 151936, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(16, 151936, device="cuda", generator=gen)
    steps = torch.arange(16, device="cuda")
    assert use_triton_kernels(logits)
    fused = Sampler()(logits, info, steps)
    with native_only():
        assert torch.equal(fused, Sampler()(logits, info, steps))
