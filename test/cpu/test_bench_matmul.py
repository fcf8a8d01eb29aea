"""benchmark/tuning/bench_matmul.py's projections and launch choices on the CPU (timing needs a
CUDA GPU)."""

from __future__ import annotations

import pytest
import torch

from script_import import import_script


@pytest.fixture
def bench():
    return import_script("benchmark/tuning/bench_matmul.py")


def test_projections_of_llama_8b_are_its_weight_shapes(bench):
    assert bench.projections(bench.model_config("llama-3.1-8b")) == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    }


def test_a_mixture_of_experts_has_its_router_in_place_of_the_mlp(bench):
    assert bench.projections(bench.model_config("qwen3-30b-a3b")) == {
        "qkv": (5120, 2048),
        "o": (2048, 4096),
        "router": (128, 2048),
        "lm_head": (151936, 2048),
    }


def test_fp8_weights_are_e4m3_within_range_with_per_channel_scales(bench):
    weights = [torch.randn(64, 32), torch.randn(64, 32)]
    quantized, scale = bench.fp8_weights(weights)
    assert [q.dtype for q in quantized] == [torch.float8_e4m3fn] * 2 and scale.shape == (64,)
    torch.testing.assert_close(quantized[0].float() * scale[:, None], weights[0], rtol=0.07, atol=0)
    assert bench.config_choice(4096, 14336, "default", fp8=True) == bench.matmul_config(
        4096, 14336, fp8=True
    )


def test_config_choices_change_the_default_launch_by_known_fields(bench):
    assert bench.CONFIG_CHOICES["default"] == {}
    fields = set(bench.MatmulConfig.__dataclass_fields__)
    default = bench.matmul_config(28672, 4096)
    for name, changes in bench.CONFIG_CHOICES.items():
        assert set(changes) <= fields
        config = bench.config_choice(28672, 4096, name)
        assert {f: getattr(config, f) for f in changes} == changes
        assert all(getattr(config, f) == getattr(default, f) for f in fields - set(changes))
