"""FP8 models on the CPU (float32 activations, FP8 matmuls emulated) from tiny checkpoints.

Each FP8 checkpoint layout (tiny_checkpoints.FP8_LAYOUTS: DeepSeek/Qwen3 128x128 blocks with a
ragged last block, AutoFP8's per-tensor weights with static input scales, llm-compressor's
per-channel dynamic and per-tensor static ones, and a mixture of experts in blocks) is written
from a tiny transformers model, loaded, and run through a ragged prefill and paged decode steps
against transformers' own forward of the same model with the dequantized weights:

- the weights exactly: with the FP8 layers' inputs left unquantized, every next-token logit row
  equals the reference's to 1e-4;
- with the inputs quantized in both, as the FP8 layers do (per token, per token and
  block-column group, or with the static scale), the rows agree to 1e-4 but where an input
  element lands within float32 rounding of an e4m3 rounding boundary and rounds the other way
  in one of them (moving that row, and through the KV cache that request's later ones): at
  least 90% of the rows to 1e-4, every row within 10% by norm, with the same top token.

`--quantization fp8` quantizes a float checkpoint at load: its model equals the same reference
with per-channel scales, and keeps the unquantized model's top token on most positions. Two
tensor-parallel ranks give one rank's logits (to 1e-4 where each rank quantizes its inputs as
one rank does: block groups on whole blocks, static scales; per token the row-parallel layers'
ranks each take their own columns' amax, so only close). A missing scale is named; unsupported
schemes fail the start with one line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from replaylm.distributed.parallel_state import TPPlace
from replaylm.layers.linear import Linear
from replaylm.layers.moe.layer import FusedMoE
from replaylm.layers.quantization import fp8_linear as fp8_linear_module
from replaylm.layers.quantization.config import resolve_quantization
from replaylm.layers.quantization.fp8 import CLIP_RATIOS, FP8_DTYPE, FP8_MAX
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.models import llama
from replaylm.models.config import ModelConfig
from replaylm.models.registry import get_model_class
from replaylm.runtime.batch_ops import prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

from model_parity import make_runner, prefill_then_decode, rel_error
from tiny_checkpoints import (
    E4M3_MAX,
    QUANTIZED_WEIGHT,
    eager_experts,
    write_fp8_checkpoint,
    write_tiny_checkpoint,
)
from tp_ranks import cpu_args, run_ranks, runner_logits

close = functools.partial(torch.testing.assert_close, atol=1e-4, rtol=1e-4)


def _fp8_args(model_path: Path, **extra: object) -> ServerArgs:
    return cpu_args(model_path, **{"max_total_tokens": 1024, **extra})


# ---- the reference: transformers, its linear layers' inputs quantized as FP8 layers do ----


def _quantize_dequantize(x: torch.Tensor, group: int | None, static: float | None) -> torch.Tensor:
    """`x` through e4m3 and back as an FP8 layer quantizes its input: one static scale, or a
    scale (the amax over 448) per token, or per token and `group`-column group."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if static is not None:
        scale = torch.tensor(static, dtype=torch.float32).expand(rows.shape)
    else:
        scale = torch.empty_like(rows)
        width = group or rows.shape[1]
        for start in range(0, rows.shape[1], width):
            part = rows[:, start : start + width]
            amax = part.abs().amax(dim=1, keepdim=True)
            scale[:, start : start + width] = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (rows / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


@contextmanager
def _fp8_inputs(
    model: PreTrainedModel,
    group: int | None = None,
    static: dict[str, float] | None = None,
    ignore: tuple[str, ...] = (),
) -> Iterator[None]:
    """While active, `model`'s quantized linear layers (those FP8 checkpoints quantize, less
    `ignore`; each expert's projections too) see their inputs quantized and dequantized
    (`static`: each module's input scale, else dynamic). F.linear is patched: it finds the
    layers by their weights' addresses, the experts' included."""
    static = static or {}
    inputs = {}
    for name, module in model.named_modules():
        quantized = QUANTIZED_WEIGHT.fullmatch(f"{name}.weight") and name not in ignore
        if isinstance(module, nn.Linear) and quantized:
            qdq = functools.partial(_quantize_dequantize, group=group, static=static.get(name))
            inputs[module.weight.data_ptr()] = qdq
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for expert in param:
                inputs[expert.data_ptr()] = functools.partial(
                    _quantize_dequantize, group=group, static=None
                )
    real = nn.functional.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        qdq = inputs.get(w.data_ptr())
        return real(x if qdq is None else qdq(x), w, b)

    nn.functional.linear = linear
    try:
        yield
    finally:
        nn.functional.linear = real


def _quantize_in_place(model: PreTrainedModel) -> None:
    """`model`'s quantized weights per channel through e4m3 and back, as `--quantization fp8`
    quantizes them (each expert's rows alike)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if stacked or QUANTIZED_WEIGHT.fullmatch(name):
                for matrix in param.view(-1, *param.shape[-2:]):
                    matrix.copy_(_round_trip_at_load(matrix))


def _round_trip_at_load(w: torch.Tensor) -> torch.Tensor:
    """`w` through e4m3 and back as `--quantization fp8` takes each row's scale: of the
    `CLIP_RATIOS` fractions of amax / 448, the one of least squared error (the first on a
    tie)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    backs = []
    for ratio in CLIP_RATIOS:
        scale = amax * ratio / FP8_MAX
        backs.append((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale)
    pick = torch.stack([(back - w).square().sum(dim=1) for back in backs]).argmin(dim=0)
    return torch.stack(backs)[pick, torch.arange(w.shape[0])]


def _assert_matches_reference(
    reference: PreTrainedModel,
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    static: dict[str, float] | None = None,
    ignore: tuple[str, ...] = (),
    steps: int = 6,
) -> None:
    """The module docstring's two comparisons: the weights exactly (the FP8 layers' inputs
    left unquantized), then the inputs quantized in both."""
    with monkeypatch.context() as unquantized:
        unquantized.setattr(
            fp8_linear_module,
            "quantize_activation",
            lambda x, group=None, static_scale=None: (x.float(), None),
        )
        unquantized.setattr(fp8_linear_module, "dequantize_activation", lambda q, *_: q)
        prefill_then_decode(reference, runner, close, steps)
    quant = runner.model.config.quantization
    assert quant is not None
    group = None if quant.block_size is None else quant.block_size[1]
    rows: list[tuple[float, float, bool]] = []

    def record(ours: torch.Tensor, ref: torch.Tensor) -> None:
        diff = float((ours - ref).abs().max())
        rows.append((diff, rel_error(ours, ref), bool(ours.argmax() == ref.argmax())))

    with _fp8_inputs(reference, group, static, ignore):
        prefill_then_decode(reference, runner, record, steps)
    assert sum(diff <= 1e-4 for diff, _, _ in rows) >= 0.9 * len(rows), rows
    assert all(rel < 0.1 and same for _, rel, same in rows), rows


# ---- each checkpoint layout against its reference -----------------------------------------


@pytest.mark.parametrize(
    ("kind", "layout", "block"),
    [
        ("llama3_blocks", "fp8_block", None),  # 128x128, ragged along rows and columns
        ("llama3", "fp8_tensor_static", None),  # per-tensor scales `[]`, static inputs
        ("qwen2", "ct_channel", None),  # per-channel scales `[N, 1]`, QKV biases
        ("qwen3", "ct_tensor_static", None),  # `[1]` scales, q/k norm, tied, one KV head
        ("qwen3_moe", "fp8_block", [32, 48]),  # FP8 experts; 64 and 32 columns ragged in 48s
    ],
)
def test_checkpoint_matches_its_dequantized_reference(
    tmp_path: Path,
    kind: str,
    layout: str,
    block: list[int] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference, static = write_fp8_checkpoint(kind, tmp_path, layout, block)
    runner = make_runner(str(tmp_path), "cpu", "float32")
    fp8 = [m for m in runner.model.modules() if isinstance(m, (Linear, FusedMoE)) and m.quant]
    assert fp8 and all(
        p.dtype == FP8_DTYPE for m in fp8 for n, p in m.named_parameters() if n.endswith("weight")
    )
    assert runner.model.model.embed_tokens.weight.dtype == torch.float32
    _assert_matches_reference(reference, runner, monkeypatch, static)


def test_an_ignored_layer_stays_unquantized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The ignore list names layer 1's down projection: it loads in float32, the rest in FP8;
    the start-up log says so."""
    ignored = ("model.layers.1.mlp.down_proj",)
    reference, _ = write_fp8_checkpoint("llama3", tmp_path, "ct_channel", ignore=ignored)
    with caplog.at_level(logging.INFO, logger="replaylm.model_loader.loader"):
        runner = make_runner(str(tmp_path), "cpu", "float32")
    assert (
        "FP8 e4m3 weights, per-channel scales, from the checkpoint (compressed-tensors); "
        "activations dynamic per token: 7 linear layers in FP8; left unquantized by the "
        "checkpoint's ignore list: 1; unquantized: model.embed_tokens, "
        "model.layers.1.mlp.down_proj, lm_head; FP8 matmuls emulated on the CPU (dequantized "
        "per matmul)"
    ) in caplog.messages
    layers = runner.model.model.layers
    assert layers[1].mlp.down_proj.quant is None
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    _assert_matches_reference(reference, runner, monkeypatch, ignore=ignored, steps=2)


def test_a_missing_scale_is_named(tmp_path: Path) -> None:
    write_fp8_checkpoint("llama3_blocks", tmp_path, "fp8_block")
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    save_file(tensors, str(weights))
    with pytest.raises(ValueError) as err:
        make_runner(str(tmp_path), "cpu", "float32")
    assert str(err.value) == (
        "checkpoint is missing 1 tensors: model.layers.0.self_attn.qkv_proj.weight_scale (k)"
    )


def test_block_scales_that_a_rank_would_split_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128-row blocks over 2 ranks of 4 heads of 32: each rank's 64 q rows are half a block."""
    write_fp8_checkpoint("llama3_blocks", tmp_path, "fp8_block")
    config = ModelConfig.from_json_file(str(tmp_path / "config.json"))
    config = dataclasses.replace(config, quantization=resolve_quantization(config.hf_config, None))
    monkeypatch.setattr(llama, "tp_place", lambda: TPPlace(0, 2))
    with pytest.raises(ValueError) as err:
        get_model_class(config.architecture)(config)
    message = str(err.value)
    assert message.startswith("--tp-size splits a weight's 128 rows at 0..64, inside FP8 blocks")
    assert "[128, 128]" in message


# ---- quantizing at load ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama3", "qwen3_moe"])
def test_quantize_at_load_matches_its_reference(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = write_tiny_checkpoint(kind, tmp_path)
    runner = load_model_runner(resolve_engine_config(_fp8_args(tmp_path, quantization="fp8")))
    _quantize_in_place(eager_experts(reference))
    _assert_matches_reference(reference, runner, monkeypatch, steps=4)


def _runner(model_path: Path, **extra: object) -> ModelRunner:
    """A runner whose prefill holds every prefix of four prompts (`_every_position_logits`)."""
    args = _fp8_args(model_path, max_running_requests=128, max_total_tokens=2048, **extra)
    return load_model_runner(resolve_engine_config(args))


def _every_position_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits after every prefix of every prompt, as one prefill batch."""
    reqs = [
        Req(f"{i}-{n}", prompt[:n], SamplingParams(), 0, 1)
        for i, prompt in enumerate(prompts)
        for n in range(1, len(prompt) + 1)
    ]
    logits = runner.forward(prepare_extend(reqs, runner)).float().clone()
    for req in reqs:
        release(req, runner.kv)
    return logits


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def test_quantize_at_load_keeps_the_top_token_on_most_positions(tmp_path: Path) -> None:
    """Each weight and input within e4m3's half step: the tiny random model's logits (whose top
    two are often close) move by about a seventh of their norm; its top token stays on most of
    96 positions, and on every one where it leads by more than 1."""
    write_tiny_checkpoint("llama3", tmp_path)
    prompts = _prompts(4, 24, 320)
    want = _every_position_logits(_runner(tmp_path), prompts)
    runner = _runner(tmp_path, quantization="fp8")
    got = _every_position_logits(runner, prompts)
    assert rel_error(got, want) < 0.3
    same = got.argmax(-1) == want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    assert same.float().mean() >= 0.7 and same[top2[:, 0] - top2[:, 1] > 1.0].all()
    weights = {n: p.dtype for n, p in runner.model.named_parameters()}
    assert weights["model.layers.0.self_attn.qkv_proj.weight"] == FP8_DTYPE
    assert weights["model.layers.0.self_attn.qkv_proj.weight_scale"] == torch.float32
    assert weights["model.embed_tokens.weight"] == weights["lm_head.weight"] == torch.float32


# ---- tensor parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "block"),
    [("fp8_block", [16, 16]), ("ct_channel_static", None)],
    ids=["blocks", "channels_static"],
)
def test_two_ranks_match_one(tmp_path: Path, layout: str, block: list[int] | None) -> None:
    """Each rank's rows and columns whole 16-blocks, its inputs' groups whole too; or
    per-channel scales (a column-parallel rank's rows of them, a row-parallel rank all) with
    static input scales: each rank quantizes its inputs as one rank does, so the logits are
    one rank's."""
    write_fp8_checkpoint("llama3", tmp_path, layout, block)
    args = _fp8_args(tmp_path)
    ref = runner_logits(args, rank=0)
    ours = run_ranks(runner_logits, dataclasses.replace(args, tp_size=2))
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")


def test_two_ranks_of_per_token_inputs_stay_close_to_one(tmp_path: Path) -> None:
    """Per-channel weights, per-token inputs: a row-parallel layer's ranks each scale their own
    columns of a token (finer than one rank's whole row), so the logits differ by activation
    rounding only."""
    write_fp8_checkpoint("llama3", tmp_path, "ct_channel")
    args = _fp8_args(tmp_path)
    ref = runner_logits(args, rank=0)
    ours = run_ranks(runner_logits, dataclasses.replace(args, tp_size=2))
    for a, b in zip(ours, ref, strict=True):
        assert rel_error(torch.from_numpy(a), torch.from_numpy(b)) < 0.2
    agree = np.mean([(a.argmax(-1) == b.argmax(-1)).mean() for a, b in zip(ours, ref, strict=True)])
    assert agree >= 0.7


# ---- dummy weights and start-up errors -------------------------------------------------------


def test_dummy_fp8_weights_are_the_float_draw_quantized(tmp_path: Path) -> None:
    """`--load-format dummy --quantization fp8` draws the float model's weights and quantizes
    them; a config with a block-scaled quantization_config builds its FP8 layout."""
    config = json.loads(
        (Path(__file__).parents[2] / "benchmark/configs/qwen3-0.6b.json").read_text()
    )
    config.update(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    dummy = {"load_format": "dummy"}
    prompts = _prompts(1, 16, 512)
    want = _every_position_logits(_runner(path, **dummy), prompts)
    got = _every_position_logits(_runner(path, quantization="fp8", **dummy), prompts)
    assert rel_error(got, want) < 0.1
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    path.write_text(json.dumps(config))
    runner = _runner(path, **dummy)
    layer = runner.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, Linear) and layer.weight_scale is not None
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (8, 2)
    assert torch.isfinite(_every_position_logits(runner, prompts)).all()


def test_unsupported_quantization_fails_the_start_with_one_line(tmp_path: Path) -> None:
    """An AWQ config: `error: unsupported quantization: quant_method 'awq'; ...`, exit code 2;
    `--quantization fp8` does not quantize a checkpoint quantized otherwise."""
    write_tiny_checkpoint("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "replaylm.launch_server", "--device", "cpu"]
    cmd += ["--model-path", str(tmp_path), "--log-level", "warning"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "error: unsupported quantization: quant_method 'awq'; replaylm serves FP8 checkpoints"
    ), result.stderr
    with pytest.raises(ValueError, match=r"^--quantization fp8 needs an unquantized or FP8 "):
        load_model_runner(resolve_engine_config(_fp8_args(tmp_path, quantization="fp8")))
