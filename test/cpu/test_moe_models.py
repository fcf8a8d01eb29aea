"""Qwen3-MoE, Qwen2-MoE and Mixtral on the CPU in float32.

Against transformers on tiny random checkpoints (8 experts, top 2): a ragged prefill, 8 paged-KV
decode steps and a chunked prefill over a cached prefix, every next-token logit row to 1e-4;
the checkpoint's experts per tensor (the hub's layout) or stacked (transformers' own). Two
tensor-parallel ranks (gloo) give one rank's logits, each expert's columns split or, with
expert parallelism, the experts placed whole: each rank holds and loads its half of them, in
either layout, and a missing tensor of its own experts is named. The real Qwen3-30B-A3B and
Mixtral-8x7B configs are read, build with transformers' parameter count, and shrunk, run on
dummy weights alike on one rank and two (either split).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from replaylm.distributed.parallel_state import TPPlace
from replaylm.entrypoints.engine import Engine
from replaylm.layers.moe.layer import FusedMoE
from replaylm.model_executor.prefill_chunk import default_prefill_chunk, prefill_chunk
from replaylm.models import llama
from replaylm.models.config import ModelConfig
from replaylm.models.moe import MoeForCausalLM, MoeSpec, Qwen2MoeForCausalLM
from replaylm.models.registry import get_model_class
from replaylm.server_args import ServerArgs

from model_parity import (
    CONFIGS,
    TINY_SHAPE,
    chunked_prefill_over_prefix,
    make_runner,
    prefill_then_decode,
)
from tiny_checkpoints import TINY_MOE_CONFIGS, write_tiny_checkpoint
from tp_ranks import cpu_args, run_ranks, runner_logits

close = functools.partial(torch.testing.assert_close, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=sorted(TINY_MOE_CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[Path, PreTrainedModel]:
    """A tiny checkpoint's folder (experts per tensor) and its transformers model."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, write_tiny_checkpoint(request.param, folder)


def _assert_two_ranks_match(args: ServerArgs, ref: list[np.ndarray], **two_ranks: object) -> None:
    """Assert 2 ranks' `runner_logits` (and greedy tokens) of `args` (with `two_ranks`'
    changes) are `ref`, one rank's."""
    ours = run_ranks(runner_logits, dataclasses.replace(args, tp_size=2, **two_ranks))
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {step}: greedy tokens differ"


def _assert_two_ranks_match_one(args: ServerArgs) -> list[np.ndarray]:
    """Assert 2 ranks' `runner_logits` are one rank's; return one rank's."""
    ref = runner_logits(args, rank=0)
    _assert_two_ranks_match(args, ref)
    return ref


@pytest.fixture(scope="module")
def one_rank(checkpoint: tuple[Path, PreTrainedModel]) -> list[np.ndarray]:
    """`runner_logits` of the checkpoint on one rank."""
    return runner_logits(cpu_args(checkpoint[0]), rank=0)


def _build_for_rank(
    folder: Path, place: TPPlace, monkeypatch: pytest.MonkeyPatch
) -> llama.LlamaForCausalLM:
    """The model of the checkpoint at `folder` built as rank `place` builds it (no process
    group: building and loading make no collective), its weights not loaded yet."""
    config = ModelConfig.from_json_file(str(folder / "config.json"))
    monkeypatch.setattr(llama, "tp_place", lambda: place)
    return get_model_class(config.architecture)(config)


def test_logits_match_hf(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    folder, hf_model = checkpoint
    runner = make_runner(str(folder), "cpu", "float32")
    prefill_then_decode(hf_model, runner, close)
    chunked_prefill_over_prefix(hf_model, runner, close)


def test_stacked_experts_checkpoint_matches_hf(
    checkpoint: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    """transformers' in-memory names: `mlp.experts.gate_up_proj` / `down_proj` per layer."""
    folder, hf_model = checkpoint
    shutil.copy(folder / "config.json", tmp_path)
    tensors = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    assert any(name.endswith(".mlp.experts.gate_up_proj") for name in tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    prefill_then_decode(hf_model, make_runner(str(tmp_path), "cpu", "float32"), close, steps=2)


def test_two_ranks_match_one(
    checkpoint: tuple[Path, PreTrainedModel], one_rank: list[np.ndarray]
) -> None:
    """Each expert's intermediate columns (and Qwen2-MoE's shared expert) split over 2 ranks."""
    _assert_two_ranks_match(cpu_args(checkpoint[0]), one_rank)


def test_expert_parallel_two_ranks_match_one(
    checkpoint: tuple[Path, PreTrainedModel], one_rank: list[np.ndarray]
) -> None:
    """The experts placed whole, 4 on each rank; the shared expert still split by columns."""
    _assert_two_ranks_match(cpu_args(checkpoint[0]), one_rank, enable_expert_parallel=True)


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_each_expert_parallel_rank_holds_and_loads_its_half_of_the_experts(
    checkpoint: tuple[Path, PreTrainedModel],
    stacked: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank r of 2 holds experts 4r..4r+3 of every sparse layer whole (the checkpoint's
    tensors of the others skipped); the router stays whole, Qwen2-MoE's shared expert split
    by columns."""
    folder, hf_model = checkpoint
    hf = {name: t.detach() for name, t in hf_model.state_dict().items()}
    tensors = hf if stacked else load_file(str(folder / "model.safetensors"))
    for rank in range(2):
        model = _build_for_rank(folder, TPPlace(rank, 2, expert_parallel=True), monkeypatch)
        model.load_weights(tensors.items())
        params = dict(model.named_parameters())
        sparse = [n.removesuffix(".w13_weight") for n in params if n.endswith(".w13_weight")]
        assert sparse
        mine = slice(4 * rank, 4 * rank + 4)
        for experts in sparse:
            assert params[f"{experts}.w13_weight"].shape[0] == 4
            torch.testing.assert_close(
                params[f"{experts}.w13_weight"], hf[f"{experts}.gate_up_proj"][mine]
            )
            torch.testing.assert_close(
                params[f"{experts}.w2_weight"], hf[f"{experts}.down_proj"][mine]
            )
            router = experts.removesuffix(".experts") + ".gate.weight"
            assert params[router].shape == (8, 64)
        shared = params.get("model.layers.0.mlp.shared_expert.gate_up_proj.weight")
        assert shared is None or shared.shape == (48, 64)  # half of 48 gate and 48 up rows


_MISSING_UP = (
    "checkpoint is missing 1 tensors: model.layers.0.mlp.experts.w13_weight (expert 3 up_proj)"
)


def _without_expert_3_up(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors less layer 0's expert 3's up projection (Mixtral's `w3`)."""
    tensors = load_file(str(folder / "model.safetensors"))
    up = re.compile(r"model\.layers\.0\.\w+\.experts\.3\.(up_proj|w3)\.weight")
    del tensors[next(name for name in tensors if up.fullmatch(name))]
    return tensors


def test_a_missing_tensor_of_its_own_experts_is_named_on_that_rank_only(
    checkpoint: tuple[Path, PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert 3 is rank 0's: rank 1 loads without it."""
    folder, _ = checkpoint
    tensors = _without_expert_3_up(folder)
    _build_for_rank(folder, TPPlace(1, 2, expert_parallel=True), monkeypatch).load_weights(
        tensors.items()
    )
    rank_zero = _build_for_rank(folder, TPPlace(0, 2, expert_parallel=True), monkeypatch)
    with pytest.raises(ValueError, match=f"^{re.escape(_MISSING_UP)}$"):
        rank_zero.load_weights(tensors.items())


def test_a_missing_expert_tensor_is_named(
    checkpoint: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    folder, _ = checkpoint
    shutil.copy(folder / "config.json", tmp_path)
    save_file(_without_expert_3_up(folder), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"^{re.escape(_MISSING_UP)}$"):
        make_runner(str(tmp_path), "cpu", "float32")


def test_an_expert_the_model_lacks_is_an_error() -> None:
    experts = FusedMoE(8, 64, 32, 2, True, TPPlace())
    name = "model.layers.0.mlp.experts.8.down_proj.weight"
    with pytest.raises(ValueError, match=rf"'{name}' has no parameter in the model"):
        experts.load_expert(8, "down", torch.zeros(64, 32), name)


def test_expert_columns_that_do_not_split_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"^--tp-size 3 does not divide the model's 32 expert"):
        FusedMoE(8, 64, 32, 2, True, TPPlace(0, 3))


def test_experts_that_do_not_split_whole_are_an_error() -> None:
    """Under expert parallelism the experts split, not their 32 columns (which 3 does not
    divide either)."""
    message = (
        "--tp-size 3 does not divide the model's 8 experts "
        "(placed whole under --enable-expert-parallel)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        FusedMoE(8, 64, 32, 2, True, TPPlace(0, 3, expert_parallel=True))


def test_qwen_sparse_layers_follow_the_step_and_the_dense_list() -> None:
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0, unless in mlp_only_layers."""
    config = ModelConfig.from_dict(
        {
            "architectures": ["Qwen2MoeForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 16,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    spec = Qwen2MoeForCausalLM.moe_spec(config)
    assert spec == MoeSpec(4, 2, 8, False, frozenset({1, 5}), shared_expert_size=16)


@pytest.mark.parametrize(
    ("config", "spec", "params"),
    [
        # the published checkpoints' parameter counts
        ("qwen3-30b-a3b.json", MoeSpec(128, 8, 768, True, frozenset(range(48))), 30_532_122_624),
        ("mixtral-8x7b.json", MoeSpec(8, 2, 14336, True, frozenset(range(32))), 46_702_792_704),
    ],
)
def test_real_configs_are_read_and_build_with_the_real_parameter_count(
    config: str, spec: MoeSpec, params: int
) -> None:
    model_config = ModelConfig.from_json_file(str(CONFIGS / config))
    model_cls = get_model_class(model_config.architecture)
    assert issubclass(model_cls, MoeForCausalLM)
    assert model_cls.moe_spec(model_config) == spec
    with torch.device("meta"):
        ours = model_cls(model_config)
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / config))
    assert sum(p.numel() for p in ours.parameters()) == params
    assert sum(p.numel() for p in hf.parameters()) == params


@pytest.mark.parametrize(
    ("config", "experts"),
    [
        (
            "qwen3-30b-a3b.json",
            {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        ),
        ("mixtral-8x7b.json", {}),  # 8 experts, top 2; TINY_SHAPE's intermediate size
    ],
)
def test_shrunk_real_configs_on_dummy_weights_match_on_two_ranks(
    config: str, experts: dict[str, int], tmp_path: Path
) -> None:
    """--load-format dummy fills the experts (each rank its part of the same whole draw: its
    columns of every expert, or with expert parallelism its experts)."""
    cfg = json.loads((CONFIGS / config).read_text())
    cfg.update(TINY_SHAPE, **experts)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = cpu_args(tmp_path / "config.json", load_format="dummy")
    logits = _assert_two_ranks_match_one(args)
    _assert_two_ranks_match(args, logits, enable_expert_parallel=True)
    assert all(np.isfinite(step).all() and step.std() > 0 for step in logits)


@pytest.mark.parametrize(
    ("config", "offline", "chunk", "why"),
    [
        ("qwen3-30b-a3b.json", False, 8192, "128 experts, top 8: about 512 rows per expert a step"),
        ("mixtral-8x7b.json", False, 2048, "8 experts, top 2: about 512 rows per expert a step"),
        ("qwen3-0.6b.json", False, 2048, "the default"),
        (
            "qwen3-30b-a3b.json",
            True,
            16384,
            "128 experts, top 8: about 1024 rows per expert a step, offline",
        ),
        (
            "mixtral-8x7b.json",
            True,
            4096,
            "8 experts, top 2: about 1024 rows per expert a step, offline",
        ),
        ("qwen3-0.6b.json", True, 2048, "the default"),
    ],
)
def test_the_default_prefill_chunk_gives_each_expert_its_rows(
    config: str, offline: bool, chunk: int, why: str
) -> None:
    """Without --chunked-prefill-size a mixture of experts prefills chunks that give each expert
    about 512 rows (its grouped GEMMs' tiles full), at most 8192, and offline 1024 rows, at most
    16384; a dense model keeps 2048 either way."""
    model_config = ModelConfig.from_json_file(str(CONFIGS / config))
    with torch.device("meta"):
        model = get_model_class(model_config.architecture)(model_config)
    assert default_prefill_chunk(model, offline) == (chunk, why)
    assert prefill_chunk(None, model, offline) == (chunk, why)
    assert prefill_chunk(1024, model, offline) == (1024, "--chunked-prefill-size")


def test_the_offline_engine_prefills_the_offline_chunk(tmp_path: Path) -> None:
    """The offline Engine's scheduler takes the offline chunk (8 experts, top 2: 1024 rows per
    expert, 4096 tokens) where a server's takes 512 rows (the CPU's dense chunk, 2048)."""
    write_tiny_checkpoint("qwen3_moe", tmp_path)
    engine = Engine(model_path=str(tmp_path), device="cpu", max_total_tokens=2000)
    try:
        assert engine.config.offline
        assert engine.scheduler.chunk_size == 4096
        assert default_prefill_chunk(engine.runner.model)[0] == 2048
    finally:
        engine.shutdown()
