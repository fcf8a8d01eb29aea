"""GGUF mixture-of-experts files (`qwen3moe`, `qwen2moe`, Mixtral as `llama` with experts) read
back as the HF checkpoint they were converted from.

Each file is written here the way llama.cpp's `convert_hf_to_gguf.py` writes it, from the
per-expert tensors a tiny random transformers model saves (the hub's names): experts stacked per
layer and projection, GGUF names from gguf-py's `TensorNameMap`, Mixtral's Q/K rows permuted,
norms and routers kept in float32, dims reversed by `GGUFWriter`. Variants: the fused
`ffn_gate_up_exps` (the converter's `--fuse-gate-up-exps`), old Mixtral files with one tensor per
expert, and the shared-expert gate as the vector quantized Qwen2-MoE files hold. A file then
serves its transformers model's logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType
from safetensors.torch import load_file
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from replaylm.model_loader.gguf_header import read_header
from replaylm.model_loader.gguf_loader import (
    count_gguf_tensors,
    iter_gguf_weights,
    read_gguf_config,
)
from replaylm.models.config import ModelConfig

from model_parity import make_runner, prefill_then_decode

LAYERS, EXPERTS = 2, 4
# widths in whole Q8_0 blocks (32), so that every matrix can be quantized
_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
_HF_CONFIGS: dict[str, PretrainedConfig] = {
    "qwen3moe": Qwen3MoeConfig(
        **_COMMON,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        norm_topk_prob=True,  # as Qwen3-30B-A3B's config.json
    ),
    "qwen2moe": Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=EXPERTS,
    ),
    "mixtral": MixtralConfig(**_COMMON, intermediate_size=32, num_local_experts=EXPERTS),
}
_HF_ARCHITECTURES = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
_GGUF_ARCH = {"qwen3moe": MODEL_ARCH.QWEN3MOE, "qwen2moe": MODEL_ARCH.QWEN2MOE}
# HF projection of an expert -> the GGUF one (for the per-expert files of old Mixtral GGUFs)
_MIXTRAL_PROJ = {"w1": "gate", "w2": "down", "w3": "up"}


@pytest.fixture(scope="module")
def hub_models() -> dict[str, PreTrainedModel]:
    """Per model: a tiny random transformers model (float32, eval)."""
    models = {}
    for kind, config in _HF_CONFIGS.items():
        torch.manual_seed(0)
        models[kind] = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return models


@pytest.fixture(scope="module")
def hub_tensors(hub_models, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Per model: the tensors its `save_pretrained` writes, under the hub's names."""
    tensors = {}
    for kind, model in hub_models.items():
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        tensors[kind] = load_file(folder / "model.safetensors")
    return tensors


def _llama_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """`LlamaModel.permute` of llama.cpp's converter: HF rotate-half Q/K rows -> interleaved."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama_unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `_llama_permute`: the same reshape with the two axes the other way round."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# from the file's tensors (by GGUF name, dequantized), one HF tensor as the file holds it
Source = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def _converted(
    kind: str, hub: dict[str, torch.Tensor], layout: str
) -> tuple[dict[str, torch.Tensor], dict[str, Source]]:
    """The file's tensors by GGUF name, as the converter makes them from `hub`, and where each
    hub tensor went. `layout`: `stacked` (experts stacked per projection), `fused` (gate and up
    stacked in one tensor), `per_expert` (old Mixtral files), `vector_gate` (stacked, with the
    shared-expert gate a vector [H])."""
    config = _HF_CONFIGS[kind]
    arch = MODEL_ARCH.LLAMA if kind == "mixtral" else _GGUF_ARCH[kind]
    names = gguf.get_tensor_name_map(arch, LAYERS)
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, Source] = {}
    experts: dict[tuple[int, str], dict[int, str]] = {}
    for name, tensor in hub.items():
        parts = name.split(".")
        if "experts" in parts:
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = name
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if kind == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            out[gguf_name] = _llama_permute(tensor, heads)
            sources[name] = lambda s, g=gguf_name, h=heads: _llama_unpermute(s[g], h)
        elif layout == "vector_gate" and name.endswith("shared_expert_gate.weight"):
            out[gguf_name] = tensor.reshape(-1)
            sources[name] = lambda s, g=gguf_name: s[g].reshape(1, -1)
        else:
            out[gguf_name] = tensor
            sources[name] = lambda s, g=gguf_name: s[g]
    for (layer, proj), by_expert in experts.items():
        if layout == "per_expert":  # old Mixtral files: blk.N.ffn_gate.E.weight
            for expert, hub_name in by_expert.items():
                gguf_name = f"blk.{layer}.ffn_{_MIXTRAL_PROJ[proj]}.{expert}.weight"
                out[gguf_name] = hub[hub_name]
                sources[hub_name] = lambda s, g=gguf_name: s[g]
            continue
        merged = (  # LlamaModel / Qwen2MoeModel.modify_tensors
            f"layers.{layer}.feed_forward.experts.{proj}.weight"
            if kind == "mixtral"
            else f"model.layers.{layer}.mlp.experts.{proj}.weight"
        )
        gguf_name = names.get_name(merged, try_suffixes=(".weight",))
        out[gguf_name] = torch.stack([hub[by_expert[e]] for e in range(EXPERTS)])
        for expert, hub_name in by_expert.items():
            sources[hub_name] = lambda s, g=gguf_name, e=expert: s[g][e]
    if layout == "fused":
        _fuse_gate_up(out, sources, experts)
    return out, sources


def _fuse_gate_up(
    out: dict[str, torch.Tensor],
    sources: dict[str, Source],
    experts: dict[tuple[int, str], dict[int, str]],
) -> None:
    """ModelBase.modify_tensors with `--fuse-gate-up-exps`: each layer's `ffn_gate_exps` and
    `ffn_up_exps` [E, I, H] concatenated into `ffn_gate_up_exps` [E, 2I, H]."""
    for layer in range(LAYERS):
        gate = out.pop(f"blk.{layer}.ffn_gate_exps.weight")
        up = out.pop(f"blk.{layer}.ffn_up_exps.weight")
        fused = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP].format(bid=layer) + ".weight"
        out[fused] = torch.cat([gate, up], dim=1)
        width = gate.shape[1]
        for proj, rows in (("gate_proj", slice(0, width)), ("up_proj", slice(width, None))):
            for expert, hub_name in experts[(layer, proj)].items():
                sources[hub_name] = lambda s, g=fused, e=expert, r=rows: s[g][e, r]


def _keeps_float32(gguf_name: str, tensor: torch.Tensor) -> bool:
    """The converter's rule: vectors, norms and routers stay float32 whatever the file type."""
    return tensor.dim() <= 1 or gguf_name.endswith(
        ("_norm.weight", ".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")
    )


def _write_gguf(
    path: Path, kind: str, tensors: dict[str, torch.Tensor], qtype: GGMLQuantizationType
) -> dict[str, torch.Tensor]:
    """Write the GGUF file of `kind` (its metadata as the converter's `set_gguf_parameters`);
    returns each tensor as the file holds it, dequantized by gguf-py (what reading it back
    must give)."""
    config = _HF_CONFIGS[kind]
    arch = gguf.MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA if kind == "mixtral" else _GGUF_ARCH[kind]]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, kind, config)
    stored = {}
    for name, tensor in tensors.items():
        file_type = GGMLQuantizationType.F32 if _keeps_float32(name, tensor) else qtype
        raw = gguf.quants.quantize(tensor.float().numpy(), file_type)
        writer.add_tensor(name, raw, raw_dtype=file_type)
        stored[name] = torch.from_numpy(gguf.quants.dequantize(raw, file_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _write_metadata(writer: gguf.GGUFWriter, kind: str, config: PretrainedConfig) -> None:
    """`TextModel.set_gguf_parameters` and the MoE models' additions."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if kind == "mixtral":  # LlamaModel
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
    else:  # Qwen2MoeModel
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if kind == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _gguf_file(tmp_path: Path, hub_tensors, kind: str, layout: str, qtype: str = "F32"):
    """Write one test file: its path, the file's dequantized tensors, and each hub tensor's
    source in them."""
    tensors, sources = _converted(kind, hub_tensors[kind], layout)
    path = tmp_path / f"{kind}-{layout}.gguf"
    stored = _write_gguf(path, kind, tensors, GGMLQuantizationType[qtype])
    return str(path), stored, sources


_CASES = [
    ("qwen3moe", "stacked"),
    ("qwen3moe", "fused"),
    ("qwen2moe", "stacked"),
    ("qwen2moe", "vector_gate"),
    ("mixtral", "stacked"),
    ("mixtral", "per_expert"),
]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize(("kind", "layout"), _CASES)
def test_weights_come_back_under_hub_names(tmp_path, hub_tensors, kind, layout, qtype):
    hub = hub_tensors[kind]
    path, stored, sources = _gguf_file(tmp_path, hub_tensors, kind, layout, qtype)

    got = list(iter_gguf_weights(path))

    names = [name for name, _ in got]
    assert len(names) == len(set(names)) == count_gguf_tensors(path)
    assert set(names) == set(hub)
    for name, tensor in got:
        assert tensor.dtype == torch.float32
        assert tensor.shape == hub[name].shape, name
        assert torch.equal(tensor, sources[name](stored)), name
        if qtype == "F32":
            assert torch.equal(tensor, hub[name]), name


@pytest.mark.parametrize("kind", sorted(_HF_CONFIGS))
def test_a_gguf_file_serves_the_logits_of_transformers(tmp_path, hub_models, hub_tensors, kind):
    """The whole path: the file's config builds the family's model, its tensors fill it, and
    prefill and decode give the HF model's logits."""
    path, _, _ = _gguf_file(tmp_path, hub_tensors, kind, "stacked")
    runner = make_runner(path, "cpu", "float32")
    close = functools.partial(torch.testing.assert_close, atol=1e-4, rtol=1e-4)
    prefill_then_decode(hub_models[kind], runner, close, steps=2)


def test_stacked_experts_are_views_of_one_dequantized_tensor(tmp_path, hub_tensors):
    path, _, _ = _gguf_file(tmp_path, hub_tensors, "qwen3moe", "fused", "Q8_0")
    layer0 = {n: t for n, t in iter_gguf_weights(path) if ".layers.0.mlp.experts." in n}
    storages = {t.untyped_storage().data_ptr() for t in layer0.values()}
    # gate and up of every expert: one fused tensor; down: another
    assert len(layer0) == 3 * EXPERTS and len(storages) == 2


def test_file_layout_is_llama_cpps(tmp_path, hub_tensors):
    """The written file has the dims llama.cpp's loader asks for (`create_tensor` in
    src/models/qwen2moe.cpp): experts {n_embd, n_ff_exp, n_expert} / {n_ff_exp, n_embd,
    n_expert}, router {n_embd, n_expert}, shared-expert gate {n_embd} (a trailing 1 allowed)."""
    path, _, _ = _gguf_file(tmp_path, hub_tensors, "qwen2moe", "stacked")
    config = _HF_CONFIGS["qwen2moe"]
    hidden, width = config.hidden_size, config.moe_intermediate_size
    shapes = {t.name: t.shape for t in read_header(path).tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == (hidden, width, EXPERTS)
    assert shapes["blk.1.ffn_up_exps.weight"] == (hidden, width, EXPERTS)
    assert shapes["blk.1.ffn_down_exps.weight"] == (width, hidden, EXPERTS)
    assert shapes["blk.1.ffn_gate_inp.weight"] == (hidden, EXPERTS)
    assert shapes["blk.1.ffn_gate_inp_shexp.weight"] == (hidden, 1)


_MOE_KEYS = {
    "qwen3moe": [
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    ],
    "qwen2moe": [
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    ],
    "mixtral": ["num_local_experts", "num_experts_per_tok"],
}


@pytest.mark.parametrize("kind", list(_HF_CONFIGS))
def test_config_matches_hf(tmp_path, hub_tensors, kind):
    hf = _HF_CONFIGS[kind]
    path, _, _ = _gguf_file(tmp_path, hub_tensors, kind, "stacked")

    cfg = read_gguf_config(path)

    assert cfg["architectures"] == [_HF_ARCHITECTURES[kind]]
    assert isinstance(hf, CONFIG_MAPPING[cfg["model_type"]])
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        *_MOE_KEYS[kind],
    ]:
        assert cfg[key] == getattr(hf, key), key
    model_config = ModelConfig.from_dict(cfg)
    assert model_config.architecture == cfg["architectures"][0]
    assert model_config.attention_bias == (kind == "qwen2moe")


def test_moe_file_without_expert_count_is_rejected(tmp_path):
    path = tmp_path / "no-experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="expert_count"):
        read_gguf_config(str(path))
