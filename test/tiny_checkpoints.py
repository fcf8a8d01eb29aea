"""Tiny random HF checkpoints (config.json + safetensors) written by tests, one per architecture.

Weights are drawn with a larger spread than HF's default init so that logits vary strongly with
every input and every weight: a wrong rope, mask or bias shows up far above float32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)

# Llama 3.1-style rope scaling
_LLAMA3_ROPE = dict(
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    rope_theta=50000.0,
)

TINY_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    # Llama 3.1-style rope scaling, untied LM head
    "llama3": (LlamaConfig, _LLAMA3_ROPE),
    # the same with four layers: room for an EAGLE-3 head's three distinct layers
    "llama3_deep": (LlamaConfig, dict(_LLAMA3_ROPE, num_hidden_layers=4)),
    # SmolLM-style: tied embeddings, plain rope, MHA
    "llama_tied": (LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    # SmolLM2's vocabulary, so that the built-in model's tokenizer serves it text (load tests)
    "llama_smollm2_vocab": (
        LlamaConfig,
        dict(tie_word_embeddings=True, num_key_value_heads=4, vocab_size=49152),
    ),
    "qwen2": (Qwen2Config, dict(rope_theta=1e6)),
    # Qwen3: q/k norm, head_dim independent of hidden/heads, tied
    "qwen3": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=True, num_key_value_heads=1)),
}

# mixture-of-experts models: 8 experts, top 2, sizes that split over 2 ranks. Kept apart from
# TINY_CONFIGS, whose every entry the dense parity suites (CPU and CUDA) run.
_QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_MOE_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    # q/k norm; top-k weights renormalised
    "qwen3_moe": (Qwen3MoeConfig, dict(_QWEN_MOE, head_dim=32, norm_topk_prob=True)),
    # QKV biases, a gated shared expert; layer 1 a dense MLP (`mlp_only_layers`); top-k weights
    # as the softmax gives them
    "qwen2_moe": (
        Qwen2MoeConfig,
        dict(_QWEN_MOE, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    ),
    # experts of `intermediate_size`; block_sparse_moe.experts.{e}.w1/w2/w3 in the checkpoint
    "mixtral": (
        MixtralConfig,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, rope_theta=1e6),
    ),
}

# served over HTTP with the built-in model's tokenizer (SmolLM2's vocabulary, tied); kept out of
# the parity suites' lists
TINY_SERVED_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "qwen3_moe_smollm2_vocab": (
        Qwen3MoeConfig,
        dict(TINY_MOE_CONFIGS["qwen3_moe"][1], vocab_size=49152, tie_word_embeddings=True),
    ),
}


def write_tiny_checkpoint(kind: str, folder: Path, seed: int = 0) -> PreTrainedModel:
    """Write a random `kind` checkpoint (of TINY_CONFIGS, TINY_MOE_CONFIGS or
    TINY_SERVED_CONFIGS) to `folder`; return the HF model (float32, eval)."""
    config_cls, overrides = {**TINY_CONFIGS, **TINY_MOE_CONFIGS, **TINY_SERVED_CONFIGS}[kind]
    config = config_cls(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(folder)
    return model


def write_tiny_eagle_head(
    kind: str, folder: Path, target: PretrainedConfig, seed: int = 0, layer_ids: list | None = None
) -> dict[str, torch.Tensor]:
    """Write a random EAGLE (`kind` "eagle") or EAGLE-3 ("eagle3") head for `target` to
    `folder`, in the published heads' layout (names without `model.`, EAGLE's layer as
    `layers.0.*`, EAGLE-3's as `midlayer.*` with a draft vocabulary of 200 and its `d2t` /
    `t2d` maps); `layer_ids`: EAGLE-3's `eagle_aux_hidden_state_layer_ids`. Returns the
    tensors (float32)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = target.hidden_size, target.intermediate_size
    heads, kv_heads = target.num_attention_heads, target.num_key_value_heads
    d = h // heads
    attn_in = 2 * h if kind == "eagle3" else h

    def rand(*shape: int) -> torch.Tensor:
        return 0.15 * torch.randn(*shape, generator=gen)

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(h, generator=gen)

    layer = {
        "self_attn.q_proj.weight": rand(heads * d, attn_in),
        "self_attn.k_proj.weight": rand(kv_heads * d, attn_in),
        "self_attn.v_proj.weight": rand(kv_heads * d, attn_in),
        "self_attn.o_proj.weight": rand(h, heads * d),
        "mlp.gate_proj.weight": rand(inter, h),
        "mlp.up_proj.weight": rand(inter, h),
        "mlp.down_proj.weight": rand(h, inter),
        "post_attention_layernorm.weight": norm(),
    }
    config = {  # the target's shapes and rope, either config layout's
        key: value
        for key, value in target.to_dict().items()
        if key.startswith("rope_")
        or key
        in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rms_norm_eps",
        )
    }
    config["num_hidden_layers"] = 1
    if kind == "eagle":
        config["architectures"] = ["LlamaForCausalLMEagle"]
        tensors = {f"layers.0.{k}": v for k, v in layer.items()}
        tensors |= {"fc.weight": rand(h, 2 * h), "fc.bias": rand(h)}
    else:
        draft_vocab = 200
        config |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
        if layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
        targets = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[targets] = True
        layer |= {"input_layernorm.weight": norm(), "hidden_norm.weight": norm()}
        tensors = {f"midlayer.{k}": v for k, v in layer.items()}
        tensors |= {
            "fc.weight": rand(h, 3 * h),
            "norm.weight": norm(),
            "lm_head.weight": rand(draft_vocab, h),
            "d2t": targets - torch.arange(draft_vocab),
            "t2d": t2d,
        }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return tensors
