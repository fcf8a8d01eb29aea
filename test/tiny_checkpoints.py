"""Tiny random HF checkpoints (config.json + safetensors) written by tests, one per architecture.

Weights are drawn with a larger spread than HF's default init so that logits vary strongly with
every input and every weight: a wrong rope, mask or bias shows up far above float32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
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

TINY_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    # Llama 3.1-style rope scaling, untied LM head
    "llama3": (
        LlamaConfig,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=50000.0,
        ),
    ),
    # SmolLM-style: tied embeddings, plain rope, MHA
    "llama_tied": (LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen2": (Qwen2Config, dict(rope_theta=1e6)),
    # Qwen3: q/k norm, head_dim independent of hidden/heads, tied
    "qwen3": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=True, num_key_value_heads=1)),
}


def write_tiny_checkpoint(kind: str, folder: Path, seed: int = 0) -> PreTrainedModel:
    """Write a random `kind` checkpoint to `folder`; return the HF model (float32, eval)."""
    config_cls, overrides = TINY_CONFIGS[kind]
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
