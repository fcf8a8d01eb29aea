"""FP8 weights, unit by unit (CPU): quantizing weights and activations and back, the FP8 matmul's
emulation (and, where this torch runs it on the CPU, its `torch._scaled_mm` path), reading
checkpoints' quantization configs (each unsupported scheme one line naming it), and how FP8
layers hold, shard and load their scales."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replaylm.distributed.parallel_state import TPPlace
from replaylm.distributed.sharding import Shard
from replaylm.layers.linear import Linear, MergedLinear, RowParallelLinear, set_matmul
from replaylm.layers.moe.layer import FusedMoE
from replaylm.layers.quantization import fp8 as fp8_module
from replaylm.layers.quantization import fp8_linear as fp8_linear_module
from replaylm.layers.quantization.config import Fp8Config, resolve_quantization
from replaylm.layers.quantization.fp8 import (
    FP8_DTYPE,
    dequantize_activation,
    dequantize_weight,
    quantize_activation,
    quantize_weight,
)
from replaylm.layers.quantization.fp8_linear import fp8_linear
from replaylm.layers.quantization.layout import scale_shard, whole_blocks
from replaylm.server_args import ServerArgs

from tiny_checkpoints import FP8_LAYOUTS, fp8_quantize

E4M3_HALF_SUBNORMAL = 2.0**-10  # half the spacing of e4m3's subnormals, in units of the scale
CHANNEL = Fp8Config("channel")
BLOCK = Fp8Config("block", block_size=(32, 16))


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


# ---- quantization and back ----------------------------------------------------------------


@pytest.mark.parametrize("block", [None, (32, 16), (128, 128)], ids=["channel", "32x16", "128"])
def test_weight_round_trip_error_is_within_e4m3_half_step(block: tuple[int, int] | None) -> None:
    """Each element within a half step of e4m3's grid: 1/16 of itself (3 mantissa bits), or
    half a subnormal step of its scale for the smallest; 160 x 200 leaves ragged last blocks."""
    w = _weight(160, 200)
    q, scale = quantize_weight(w, block)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    shapes = {None: (160,), (32, 16): (5, 13), (128, 128): (2, 2)}
    assert scale.shape == shapes[block]
    back = dequantize_weight(q, scale, block)
    per_element = (
        scale[:, None] if block is None else fp8_module.expand_block_scale(scale, block, 160, 200)
    )
    bound = w.abs() / 16 + per_element * E4M3_HALF_SUBNORMAL
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    normal = w.abs() > per_element * 2.0**-6  # e4m3's normal range
    assert ((back - w).abs() / w.abs())[normal].max() < 0.07


def test_values_on_the_grid_round_trip_exactly() -> None:
    """A weight that is e4m3 values times a power-of-two scale per row, each row reaching 448
    (so that the scale is found again), comes back bit for bit."""
    grid = torch.randn(64, 96).to(FP8_DTYPE).float()
    grid[:, 0] = 448.0
    w = grid * 2.0 ** torch.randint(-8, 4, (64, 1)).float()
    q, scale = quantize_weight(w, None)
    assert torch.equal(dequantize_weight(q, scale, None), w)
    assert torch.equal(q.float(), grid)


@pytest.mark.parametrize("block", [None, (32, 48)], ids=["channel", "blocks"])
def test_quantizing_a_few_rows_at_a_time_changes_nothing(
    block: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stacked experts too: `[E, N, K]` scales per expert."""
    w = torch.randn(3, 100, 70, generator=torch.Generator().manual_seed(1))
    whole = quantize_weight(w, block)
    monkeypatch.setattr(fp8_module, "CHUNK_ELEMENTS", 64 * 70)
    chunked = quantize_weight(w, block)
    assert torch.equal(whole[0].float(), chunked[0].float())
    assert torch.equal(whole[1], chunked[1])
    for e in range(3):
        assert torch.equal(quantize_weight(w[e], block)[1], whole[1][e])


def test_checkpoint_layouts_quantize_as_replaylm_does() -> None:
    """The test checkpoints' independent quantizer (tiny_checkpoints: amax / 448, as checkpoints
    are made) and ours agree on blocks; per channel ours takes, row by row, a fraction of that
    scale (`CLIP_RATIOS`) whose round trip is no worse, smaller on some rows."""
    w = _weight(160, 200, seed=3)
    q, scale, _ = fp8_quantize(w, "block", (128, 128))
    ours = quantize_weight(w, (128, 128))
    assert torch.equal(q.float(), ours[0].float()) and torch.allclose(scale, ours[1])
    q, scale, _ = fp8_quantize(w, "channel")
    ours_q, ours_scale = quantize_weight(w, None)
    ratios = ours_scale / scale[:, 0]
    assert all(any(abs(r - c) < 1e-6 for c in fp8_module.CLIP_RATIOS) for r in ratios.tolist())
    assert (ratios < 1).any()

    def row_errors(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (dequantize_weight(q, s, None) - w).square().sum(dim=-1)

    assert (row_errors(ours_q, ours_scale) <= row_errors(q, scale[:, 0])).all()
    same = ratios == 1
    assert torch.equal(ours_q[same].float(), q[same].float())


@pytest.mark.parametrize("group", [None, 48], ids=["per_token", "per_token_group"])
def test_activation_quantization_per_token_and_group(group: int | None) -> None:
    """Each token's (each group's: 100 columns in groups of 48, the last of 4) amax maps to
    448; an all-zero token quantizes to zeros."""
    x = torch.randn(5, 100) * torch.tensor([1.0, 10.0, 0.01, 0.0, 3.0])[:, None]
    q, scale = quantize_activation(x, group)
    assert scale.shape == ((5, 1) if group is None else (5, 3)) and scale.is_contiguous()
    back = dequantize_activation(q, scale, group)
    assert torch.equal(back[3], torch.zeros(100))
    width = 100 if group is None else group
    for t in (0, 1, 2, 4):
        for start in range(0, 100, width):
            part = x[t, start : start + width]
            assert float(q[t, start : start + width].float().abs().max()) == 448.0
            assert ((back[t, start : start + width] - part).abs() <= part.abs().max() / 16).all()


def test_static_activation_scale_is_the_largest_of_the_layer() -> None:
    x = torch.randn(4, 32)
    q, scale = quantize_activation(x, static_scale=torch.tensor([0.01, 0.02, 0.005]))
    assert torch.equal(scale, torch.full((4, 1), 0.02))
    assert torch.equal(q, (x / 0.02).clamp(-448, 448).to(FP8_DTYPE))


# ---- the FP8 matmul -----------------------------------------------------------------------


@pytest.mark.parametrize("block", [None, (32, 16)], ids=["channel", "blocks"])
def test_emulated_matmul_is_the_quantized_input_times_the_dequantized_weight(
    block: tuple[int, int] | None,
) -> None:
    """A 3-D bfloat16 input, a bias: computed in float32, returned in the input's dtype."""
    w, x = _weight(48, 40), torch.randn(2, 3, 40).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    q, scale = quantize_weight(w, block)
    y = fp8_linear(x, q, scale, block, bias)
    group = None if block is None else block[1]
    rows = dequantize_activation(*quantize_activation(x.reshape(6, 40), group), group)
    want = F.linear(rows, dequantize_weight(q, scale, block)).to(torch.bfloat16) + bias
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 48)
    assert torch.equal(y, want.reshape(2, 3, 48))
    assert fp8_linear(x, q, scale, block, out_dtype=torch.float32).dtype == torch.float32


def test_scaled_mm_path_matches_the_emulation() -> None:
    """The CUDA path's `torch._scaled_mm` call (row-wise scales, the weight column-major), run
    where this torch has the op on the CPU."""
    w, x = _weight(64, 32), torch.randn(8, 32).to(torch.bfloat16)
    q, scale = quantize_weight(w, None)
    try:
        got = fp8_linear_module._scaled_mm(x, q, scale, None, torch.bfloat16, None)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {err}")
    want = fp8_linear_module._emulated(x, q, scale, None, None)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


# ---- quantization configs -----------------------------------------------------------------


def test_each_test_layout_parses_to_its_scheme() -> None:
    want = {
        "fp8_block": Fp8Config("block", "dynamic", (128, 128)),
        "fp8_tensor_static": Fp8Config("tensor", "static"),
        "ct_channel": Fp8Config("channel", ignored=("lm_head",), method="compressed-tensors"),
        "ct_tensor_static": Fp8Config(
            "tensor", "static", ignored=("re:.*lm_head",), method="compressed-tensors"
        ),
        "ct_channel_static": Fp8Config(
            "channel", "static", ignored=("re:.*lm_head",), method="compressed-tensors"
        ),
    }
    for layout, (quant, _, _) in FP8_LAYOUTS.items():
        assert resolve_quantization({"quantization_config": quant}, None) == want[layout]
        assert resolve_quantization({"quantization_config": quant}, "fp8") == want[layout]


def _ct(weights: dict, acts: dict | None = None, **extra: object) -> dict:
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {
        "targets": ["Linear"],
        "weights": {**fp8, "strategy": "channel", **weights},
        "input_activations": {**fp8, "strategy": "token", "dynamic": True, **(acts or {})},
    }
    return {"quant_method": "compressed-tensors", "config_groups": {"g": group}, **extra}


def test_compressed_tensors_block_and_kv_scales() -> None:
    quant = _ct(
        {"strategy": "block", "block_structure": [128, 128]},
        {"strategy": "group", "group_size": 128},
        kv_cache_scheme={"num_bits": 8, "type": "float"},
    )
    config = resolve_quantization({"quantization_config": quant}, None)
    assert config == Fp8Config(
        "block", block_size=(128, 128), method="compressed-tensors", kv_cache_scales=True
    )
    assert "KV-cache scales in the checkpoint" in config.describe()


def test_quantize_at_load_only_with_the_flag() -> None:
    assert resolve_quantization({}, None) is None
    assert resolve_quantization({}, "fp8") == Fp8Config("channel", quantize_at_load=True)
    assert (
        "quantized at load (--quantization fp8)"
        in Fp8Config("channel", quantize_at_load=True).describe()
    )


_SUPPORTED = "replaylm serves FP8 checkpoints"


@pytest.mark.parametrize(
    ("quant", "scheme"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq"}, "quant_method 'gptq'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 with fmt 'e5m2' (only e4m3)"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "fp8 with block scales and static activations",
        ),
        (_ct({"num_bits": 8, "type": "int"}), "compressed-tensors with 8-bit int weights"),
        (_ct({"num_bits": 4, "type": "int"}), "compressed-tensors with 4-bit int weights"),
        (_ct({"symmetric": False}), "compressed-tensors with asymmetric weights"),
        (
            _ct({"strategy": "group", "group_size": 128}),
            "compressed-tensors with weight strategy 'group'",
        ),
        (
            {**_ct({}), "format": "pack-quantized"},
            "compressed-tensors format 'pack-quantized' (FP8 is float-quantized)",
        ),
        (
            _ct({}, {"strategy": "token", "dynamic": False}),
            "compressed-tensors with static activation strategy 'token'",
        ),
        (
            _ct({}, {"num_bits": 8, "type": "int"}),
            "compressed-tensors with 8-bit int activations",
        ),
    ],
)
def test_unsupported_schemes_are_one_line_naming_them(quant: dict, scheme: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_quantization({"quantization_config": quant}, None)
    message = str(err.value)
    assert message.startswith(f"unsupported quantization: {scheme}") and "\n" not in message
    assert _SUPPORTED in message
    with pytest.raises(ValueError, match=r"^--quantization fp8 needs an unquantized or FP8 "):
        resolve_quantization({"quantization_config": quant}, "fp8")


def test_weight_only_fp8_is_refused() -> None:
    quant = _ct({})
    del quant["config_groups"]["g"]["input_activations"]
    with pytest.raises(ValueError, match="without input_activations"):
        resolve_quantization({"quantization_config": quant}, None)


def test_ignore_lists_match_names_parents_and_patterns() -> None:
    config = Fp8Config(
        "channel",
        ignored=("lm_head", "model.layers.0.mlp", "re:.*mlp\\.gate$", "model.layers.*.self_attn"),
    )
    for ignored in (
        "lm_head",
        "model.layers.0.mlp.down_proj",
        "model.layers.3.mlp.gate",
        "model.layers.5.self_attn.q_proj",
    ):
        assert config.ignores(ignored), ignored
    for quantized in ("model.layers.1.mlp.down_proj", "model.layers.3.mlp.gate_proj"):
        assert not config.ignores(quantized), quantized


def test_the_flag_and_its_choices() -> None:
    assert ServerArgs(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="--quantization must be one of fp8, got 'int8'"):
        ServerArgs(quantization="int8").validate()


# ---- layers: scales' shapes, parts and loading ------------------------------------------------


def test_block_parts_must_be_whole_blocks() -> None:
    assert whole_blocks(Shard(0, 128, 128, 256), (128, 64)) == Shard(0, 1, 1, 2)
    assert whole_blocks(Shard(1, 128, 32, 160), (128, 128)) == Shard(1, 1, 1, 2)  # ragged end
    with pytest.raises(ValueError) as err:
        whole_blocks(Shard(0, 64, 64, 128), (128, 128))
    assert str(err.value) == (
        "--tp-size splits a weight's 128 rows at 64..128, inside FP8 blocks of 128 (the "
        "checkpoint's block size [128, 128]): choose a --tp-size whose parts are whole blocks"
    )
    assert scale_shard(Shard(0, 8, 8, 16), None) == Shard(0, 8, 8, 16)
    assert scale_shard(Shard(1, 8, 8, 16), None) is None  # a row-parallel layer's whole rows


@pytest.mark.parametrize("quant", [CHANNEL, BLOCK], ids=["channel", "blocks"])
def test_each_rank_holds_its_part_of_the_weight_and_scales(quant: Fp8Config) -> None:
    """Column- and row-parallel FP8 layers on 2 ranks: each rank's dequantized weight is its
    part of the whole layer's."""
    w = _weight(64, 96, seed=5)
    q, scale = quantize_weight(w, quant.block_size)
    whole = dequantize_weight(q, scale, quant.block_size)
    for rank in range(2):
        column = Linear(96, 32, shard=Shard(0, 32 * rank, 32, 64), quant=quant)
        row = RowParallelLinear(Shard(1, 48 * rank, 48, 96), 64, quant)
        for layer in (column, row):
            for name, full in (("weight", q), ("weight_scale", scale)):
                assert layer.full_shape(name) == tuple(full.shape)
                getattr(layer, name).data.copy_(layer.local_part(name, full))
            assert layer.weight_scale is not None
            held = dequantize_weight(layer.weight, layer.weight_scale, quant.block_size)
            part = (
                whole[32 * rank : 32 * rank + 32]
                if layer is column
                else whole[:, 48 * rank :][:, :48]
            )
            assert torch.equal(held, part)


def test_a_fused_layer_keeps_each_shards_per_tensor_scale_per_channel() -> None:
    """q, k, v of one per-tensor checkpoint have three scales: each shard's rows keep theirs
    (no requantization), so the fused weight dequantizes to the three checkpoint tensors'."""
    layer = MergedLinear(40, {"q": 32, "k": 16, "v": 16}, quant=Fp8Config("tensor", "static"))
    parts = {}
    for i, (shard, rows) in enumerate({"q": 32, "k": 16, "v": 16}.items()):
        q, scale, parts[shard] = fp8_quantize(_weight(rows, 40, seed=i), "tensor")
        layer.load_shard("weight", shard, q, f"{shard}_proj.weight")
        layer.load_shard("weight_scale", shard, scale, f"{shard}_proj.weight_scale")
        layer.load_shard("input_scale", shard, torch.tensor(0.1 * (i + 1)), "input_scale")
    assert layer.weight_scale is not None and layer.input_scale is not None
    held = dequantize_weight(layer.weight, layer.weight_scale, None)
    assert torch.equal(held, torch.cat(list(parts.values())))
    assert torch.allclose(layer.input_scale, torch.tensor([0.1, 0.2, 0.3]))


def test_fused_block_scales_need_each_shard_on_whole_blocks() -> None:
    """k's rows would start inside q's last block; the last shard may end ragged."""
    MergedLinear(40, {"q": 64, "k": 32, "v": 24}, quant=Fp8Config("block", block_size=(32, 32)))
    with pytest.raises(ValueError, match=r"the fused q/k/v layer's k rows start at 48"):
        MergedLinear(40, {"q": 48, "k": 32, "v": 32}, quant=Fp8Config("block", block_size=(32, 32)))


@pytest.mark.parametrize(
    "quant", [CHANNEL, Fp8Config("block", block_size=(16, 16))], ids=["channel", "blocks"]
)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_experts_load_per_expert_and_stacked_alike(quant: Fp8Config, expert_parallel: bool) -> None:
    """Each of 2 ranks loads its experts' (or columns') FP8 weights and scales from per-expert
    checkpoint tensors, and gets what a stacked checkpoint's `local_part` gives it."""
    experts, hidden, inter = 4, 40, 32
    gen = torch.Generator().manual_seed(2)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    stacked = {}
    for name, w in (("w13", w13), ("w2", w2)):
        stacked[f"{name}_weight"], stacked[f"{name}_weight_scale"] = quantize_weight(
            w, quant.block_size
        )
    for rank in range(2):
        place = TPPlace(rank, 2, expert_parallel=expert_parallel)
        per_expert = FusedMoE(experts, hidden, inter, 2, True, place, quant)
        whole = FusedMoE(experts, hidden, inter, 2, True, place, quant)
        for e in range(experts):
            for proj, rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter))):
                q, s = quantize_weight(w13[e, rows], quant.block_size)
                per_expert.load_expert(e, proj, q, "w")
                per_expert.load_expert(e, proj, s, "s", "w13_weight_scale")
            q, s = quantize_weight(w2[e], quant.block_size)
            per_expert.load_expert(e, "down", q, "w")
            per_expert.load_expert(e, "down", s, "s", "w2_weight_scale")
        for name, full in stacked.items():
            assert whole.full_shape(name) == tuple(full.shape)
            getattr(whole, name).data.copy_(whole.local_part(name, full))
            torch.testing.assert_close(
                getattr(per_expert, name).float(), getattr(whole, name).float(), rtol=0, atol=0
            )


def test_set_matmul_leaves_fp8_layers_to_fp8_linear() -> None:
    model = torch.nn.Sequential(
        Linear(16, 16), Linear(16, 16, quant=CHANNEL), MergedLinear(16, {"a": 16}, quant=CHANNEL)
    )
    chosen = set_matmul(model, "triton")
    assert chosen == {"triton": 1, "fp8": 2}
    assert [m.matmul for m in model] == ["triton", "cublas", "cublas"]


def test_a_layer_left_unquantized_holds_the_default_dtype() -> None:
    layer = MergedLinear(16, {"q": 16, "k": 8}, quant=Fp8Config("tensor", "static"))
    layer.make_weights(None)
    assert layer.weight.dtype == torch.float32
    assert {n for n, _ in layer.named_parameters()} == {"weight"}
