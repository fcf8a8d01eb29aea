"""The fused MoE kernels with FP8 (e4m3) experts, w8a8, on the CPU through Triton's interpreter.

`triton_experts` against `torch_experts` with the same scales: per channel, 128x128 blocks (the
hidden size 160 leaves the last block of w13's K and of w2's N ragged) and 32x64 blocks (w2's
K, the intermediate size 96, ragged too); one token and a ragged batch with experts that get no
token and other ranks' ids; rows independent of the padding rows beside them; static input
scales. Then the block configs' FP8 tables and the checks, the dispatch of `fused_experts` and
its custom op under torch.compile, and the tuning tool's FP8 options.

Tolerance: both sides quantize each GEMM's input with `quantize_activation` and multiply the
same e4m3 values exactly in float32, so they differ only in the order of the sums and of the
scale products, as the unquantized kernels do: their tolerance (test_moe_triton_interpreter.py),
its absolute part relative to the largest output (rows and columns here differ in size up to
sixteenfold, and the sums' rounding follows their terms' size, not a cancelled result's). That
order could round a requantized intermediate to the other e4m3 neighbour only within a few
float32 ulps of a rounding boundary, which these seeded inputs do not hit (it would put a
token's row off by a sixteenth of one term); dropping the activation quantization misses by far
more (`test_activation_quantization_is_resolved`).
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.moe import triton_experts as triton_module  # noqa: E402
from replaylm.layers.moe.block_configs import (  # noqa: E402
    MoeBlockConfig,
    config_file_name,
    default_config,
    fits_block,
    moe_block_config,
    write_table,
)
from replaylm.layers.moe.experts import fused_experts  # noqa: E402
from replaylm.layers.moe.torch_experts import Fp8ExpertScales, torch_experts  # noqa: E402
from replaylm.layers.moe.triton_experts import triton_experts  # noqa: E402
from replaylm.layers.quantization.fp8 import (  # noqa: E402
    FP8_DTYPE,
    Block,
    dequantize_weight,
    quantize_weight,
)

from script_import import import_script  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# scales: (block, hidden, intermediate)
LAYOUTS = {
    "channel": (None, 48, 40),
    "block128": ((128, 128), 160, 128),
    "block32x64": ((32, 64), 80, 96),
}
# 16-row blocks, K steps of 32 (several per 64- or 128-column block), column tiles ragged at N
SMALL_TILES = MoeBlockConfig(block_m=16, block_n=32, block_k=32, group_m=2)
CASES = [  # tokens, experts, top_k, unused experts, foreign slots
    (1, 4, 2, (), 0),
    (9, 6, 3, (2,), 4),  # a ragged batch, an expert without a token, other ranks' ids
]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` within `TOL` of `want`: relative, and absolute times `want`'s largest magnitude."""
    tol = TOL[want.dtype]
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_scalar_index():
    with scalar_loop_bounds():
        yield


def _spread(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Log-uniform factors in [1/4, 4]: rows and columns of different sizes, so that scales
    differ from block to block and group to group (a scale taken from the wrong one shows)."""
    return torch.exp((torch.rand(shape, generator=gen) * 2 - 1) * math.log(4))


def _fp8_experts(
    experts: int, hidden: int, inter: int, block: Block | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor, Fp8ExpertScales]:
    """Random e4m3 `w13` `[E, 2I, H]` and `w2` `[E, H, I]`, rows and columns of different sizes
    (`_spread`), with their scales per channel or per `block`."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    w13 = w13 * _spread((experts, 2 * inter, 1), gen) * _spread((experts, 1, hidden), gen)
    w2 = w2 * _spread((experts, hidden, 1), gen) * _spread((experts, 1, inter), gen)
    (q13, s13), (q2, s2) = quantize_weight(w13, block), quantize_weight(w2, block)
    return q13, q2, Fp8ExpertScales(s13, s2, block)


def _hidden(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=gen) * _spread((1, width), gen)
    return x.to(dtype)


def _routing(
    tokens: int, top_k: int, experts: int, seed: int, unused: tuple[int, ...] = (), foreign: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32 summing to 1, ids `[T, k]` int32): k distinct experts per token
    not in `unused`, then `foreign` slots set to ids outside 0..E-1 (other ranks')."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in unused])
    picks = [allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)]
    ids = torch.stack(picks).to(torch.int32)
    for i, flat in enumerate(torch.randperm(tokens * top_k, generator=gen)[:foreign].tolist()):
        ids.view(-1)[flat] = (-1, experts, experts + 5)[i % 3]
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights / weights.sum(dim=1, keepdim=True), ids


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    ("dtype", "config"),
    [(torch.float32, None), (torch.float32, SMALL_TILES), (torch.float16, SMALL_TILES)],
    ids=["float32-default", "float32-small", "float16-small"],
)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "unused", "foreign"), CASES)
def test_fp8_fused_matches_torch_experts(
    layout, dtype, config, tokens, experts, top_k, unused, foreign
):
    block, hidden, inter = LAYOUTS[layout]
    w13, w2, fp8 = _fp8_experts(experts, hidden, inter, block, seed=experts)
    weights, ids = _routing(tokens, top_k, experts, seed=tokens, unused=unused, foreign=foreign)
    x = _hidden(tokens, hidden, dtype, seed=hidden)
    got = triton_experts(x, w13, w2, weights, ids, fp8, config=config)
    want = torch_experts(x, w13, w2, weights, ids, fp8)
    assert got.dtype == dtype and got.shape == x.shape
    _assert_close(got, want)


def test_no_pair_of_this_rank_gives_zeros():
    w13, w2, fp8 = _fp8_experts(4, 160, 128, (128, 128), seed=1)
    weights, ids = _routing(6, 2, 4, seed=2, foreign=12)
    got = triton_experts(_hidden(6, 160, torch.float32, seed=3), w13, w2, weights, ids, fp8)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("layout", ["channel", "block32x64"])
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default", "small"])
def test_fp8_rows_do_not_depend_on_padding_rows(layout, config):
    """5 tokens alone and as the first rows of an 8-row batch (3 padding rows of other routes,
    one of them another rank's): per-token scales, so the 5 rows' outputs are bit-equal."""
    block, hidden, inter = LAYOUTS[layout]
    w13, w2, fp8 = _fp8_experts(4, hidden, inter, block, seed=6)
    weights, ids = _routing(8, 2, 4, seed=7, foreign=1)
    x = _hidden(8, hidden, torch.float32, seed=8)
    alone = triton_experts(x[:5], w13, w2, weights[:5], ids[:5], fp8, config=config)
    batch = triton_experts(x, w13, w2, weights, ids, fp8, config=config)
    assert torch.equal(alone, batch[:5])


def test_static_input_scales():
    """Static input scales: every token quantized with each projection's largest over the
    experts, by both sides; they are not the dynamic scales (the result differs from those)."""
    w13, w2, dynamic = _fp8_experts(4, 48, 40, None, seed=9)
    gen = torch.Generator().manual_seed(10)
    static = Fp8ExpertScales(
        dynamic.w13,
        dynamic.w2,
        None,
        torch.rand(4, 2, generator=gen),
        torch.rand(4, 1, generator=gen),
    )
    weights, ids = _routing(7, 2, 4, seed=11, foreign=2)
    x = _hidden(7, 48, torch.float32, seed=12)
    got = triton_experts(x, w13, w2, weights, ids, static)
    _assert_close(got, torch_experts(x, w13, w2, weights, ids, static))
    assert not torch.allclose(got, triton_experts(x, w13, w2, weights, ids, dynamic), rtol=1e-3)


@pytest.mark.parametrize("layout", ["channel", "block128"])
def test_activation_quantization_is_resolved(layout):
    """The tolerance sees the activations' quantization: the same e4m3 weights with unquantized
    activations (the weights dequantized) miss the kernels' result by far more than it."""
    block, hidden, inter = LAYOUTS[layout]
    w13, w2, fp8 = _fp8_experts(4, hidden, inter, block, seed=13)
    weights, ids = _routing(7, 2, 4, seed=14)
    x = _hidden(7, hidden, torch.float32, seed=15)
    got = triton_experts(x, w13, w2, weights, ids, fp8)
    w13_float = dequantize_weight(w13, fp8.w13, block)
    w2_float = dequantize_weight(w2, fp8.w2, block)
    unquantized = torch_experts(x, w13_float, w2_float, weights, ids)
    assert (got - unquantized).abs().max() > 100 * TOL[torch.float32] * got.abs().max()


def test_operands_the_fp8_kernels_refuse():
    """K steps across the blocks' scales, scales of another layout, weights not e4m3, blocks
    that split gate and up rows: ValueError."""
    w13, w2, fp8 = _fp8_experts(4, 160, 128, (128, 128), seed=16)
    weights, ids = _routing(3, 2, 4, seed=17)
    x = _hidden(3, 160, torch.float32, seed=18)
    wide_k = MoeBlockConfig(block_m=16, block_n=32, block_k=256, group_m=1)
    with pytest.raises(ValueError, match="BLOCK_K 256"):
        triton_experts(x, w13, w2, weights, ids, fp8, config=wide_k)
    per_channel = Fp8ExpertScales(fp8.w13[:, :, 0], fp8.w2[:, :, 0], (128, 128))
    with pytest.raises(ValueError, match="w13 scales"):
        triton_experts(x, w13, w2, weights, ids, per_channel)
    with pytest.raises(ValueError, match="float8_e4m3fn expected"):
        triton_experts(x, w13.float(), w2.float(), weights, ids, fp8)
    w13_96, w2_96, fp8_64 = _fp8_experts(4, 160, 96, (64, 64), seed=19)
    with pytest.raises(ValueError, match="96 intermediate columns"):
        triton_experts(x, w13_96, w2_96, weights, ids, fp8_64)


def test_fp8_tables_and_defaults(tmp_path):
    """FP8 weights' tables are named `fp8_w8a8` (plus the block shape, as vLLM spells them),
    apart from each other and from the model dtype's; without one, a default whose K steps fit
    the blocks."""
    name = config_file_name(8, 128, 160, FP8_DTYPE, "GPU", (128, 128))
    assert name == "E=8,N=128,K=160,device_name=GPU,dtype=fp8_w8a8,block_shape=[128,128].json"
    per_channel = config_file_name(8, 128, 160, FP8_DTYPE, "GPU")
    assert per_channel == "E=8,N=128,K=160,device_name=GPU,dtype=fp8_w8a8.json"
    tuned = MoeBlockConfig(32, 64, 128, 1)
    write_table(tmp_path / name, {16: tuned})

    def lookup(dtype: torch.dtype, block: Block | None) -> tuple[MoeBlockConfig, str]:
        return moe_block_config(8, 128, 160, 16, dtype, "GPU", block, config_dir=tmp_path)

    assert lookup(FP8_DTYPE, (128, 128)) == (tuned, f"table {name}")
    for dtype, block in [(FP8_DTYPE, None), (torch.bfloat16, None), (FP8_DTYPE, (128, 64))]:
        config, source = lookup(dtype, block)
        assert source == "default" and fits_block(config, block)
    for tokens in (1, 4096):
        for block in [(128, 128), (128, 48), (64, 16)]:
            config = default_config(tokens, 8, block)
            assert fits_block(config, block) and config.block_k >= 16
        assert default_config(tokens, 8, (128, 128)) == default_config(tokens, 8)


@pytest.fixture
def triton_calls(monkeypatch) -> list[tuple[int, bool]]:
    """Record each call of `triton_experts`: its tokens, whether it had FP8 scales. (The tests
    point the kernels' device at the CPU only once their reference is taken: `fp8_linear`, which
    `torch_experts` calls, runs its GPU route on the kernels' device.)"""
    calls: list[tuple[int, bool]] = []

    def counted(*args, **kwargs):
        fp8 = args[5] if len(args) > 5 else kwargs.get("fp8")
        calls.append((args[0].shape[0], fp8 is not None))
        return triton_experts(*args, **kwargs)

    monkeypatch.setattr(triton_module, "triton_experts", counted)
    return calls


def test_fp8_experts_take_the_triton_route(triton_calls, monkeypatch):
    """FP8 experts run the torch code off the kernels' device, the kernels on it: the same
    numbers. (Inside native_only() the torch code runs `fp8_linear`'s own GPU route.)"""
    block, hidden, inter = LAYOUTS["block32x64"]
    w13, w2, fp8 = _fp8_experts(4, hidden, inter, block, seed=20)
    weights, ids = _routing(6, 2, 4, seed=21, foreign=2)
    x = _hidden(6, hidden, torch.float32, seed=22)
    native = fused_experts(x, w13, w2, weights, ids, fp8)
    assert triton_calls == []
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    fused = fused_experts(x, w13, w2, weights, ids, fp8)
    assert triton_calls == [(6, True)]
    _assert_close(fused, native)


@pytest.mark.parametrize("layout", ["channel", "block32x64"])
def test_fp8_experts_trace_as_one_custom_op(triton_calls, monkeypatch, layout):
    """Under torch.compile the scales travel as the custom op's trailing arguments (the layer
    builds its `Fp8ExpertScales` inside the traced code): one graph, the eager numbers."""
    block, hidden, inter = LAYOUTS[layout]
    w13, w2, fp8 = _fp8_experts(4, hidden, inter, block, seed=23)
    weights, ids = _routing(3, 2, 4, seed=24)
    x = _hidden(3, hidden, torch.float16, seed=25)

    def layer(x, w13, w2, weights, ids, w13_scale, w2_scale):
        return fused_experts(x, w13, w2, weights, ids, Fp8ExpertScales(w13_scale, w2_scale, block))

    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    eager = layer(x, w13, w2, weights, ids, fp8.w13, fp8.w2)
    torch._dynamo.reset()
    with kernels.kernels_in_compiled_code():
        compiled = torch.compile(layer, backend="eager", fullgraph=True)
        got = compiled(x, w13, w2, weights, ids, fp8.w13, fp8.w2)
    assert triton_calls == [(3, True), (3, True)]
    assert torch.equal(got, eager)


def test_custom_op_registration_and_fake():
    """The op's fake (meta) impl gives what the real one gives, FP8 scales and all (torch's
    check; its schema check cannot run: it multiplies the e4m3 inputs, which the CPU lacks)."""
    block, hidden, inter = LAYOUTS["block32x64"]
    w13, w2, fp8 = _fp8_experts(4, hidden, inter, block, seed=26)
    weights, ids = _routing(2, 2, 4, seed=27)
    x = _hidden(2, hidden, torch.float16, seed=28)
    args = (x, w13, w2, weights, ids, fp8.w13, fp8.w2, None, None, [32, 64])
    torch.library.opcheck(
        torch.ops.replaylm.fused_experts.default,
        args,
        test_utils=("test_faketensor",),
    )


def test_tuning_tool_fp8_options():
    tool = import_script("benchmark/tuning/tune_moe.py")
    shape = ["--experts", "8", "--hidden", "64", "--intermediate", "32", "--top-k", "2"]
    args = tool.parse_args([*shape, "--dtype", "fp8_w8a8", "--block-shape", "128", "128"])
    assert args.block_shape == (128, 128)
    assert (tool.weight_dtype(args), tool.hidden_dtype(args)) == (FP8_DTYPE, torch.bfloat16)
    assert tool.parse_args([*shape, "--dtype", "fp8_w8a8"]).block_shape is None
    with pytest.raises(SystemExit):
        tool.parse_args([*shape, "--block-shape", "128", "128"])
    space = tool.search_space(4096, 8, 128, 1, (128, 128))
    assert space and {c.block_k for c in space} == {64, 128}
    assert all(tool.shared_memory_bytes(c, 1) <= tool.SHARED_MEMORY for c in space)
