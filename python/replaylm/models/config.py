"""ModelConfig: the architecture facts the engine needs, read from an HF-style config dict.

Both `config.json` layouts are accepted: the classic one (`rope_theta`, `rope_scaling`) and the
transformers >= 5 one (`rope_parameters` holding `rope_theta` and the scaling fields).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from replaylm.layers.quantization.config import Fp8Config


@dataclass(frozen=True)
class ModelConfig:
    """Normalised model hyper-parameters. `hf_config` keeps the raw dict for model-specific keys."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hf_config: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    # FP8 weights (the checkpoint's quantization_config, or --quantization), set by the loader
    # (`resolve_quantization`); None: the model's dtype throughout
    quantization: Fp8Config | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from an HF config dict; raises ValueError naming a missing required key."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config has no 'architectures' entry; cannot pick a model class")
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in cfg:
                raise ValueError(f"config is missing required key '{key}'")
        heads = int(cfg["num_attention_heads"])
        rope_params: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", False))),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf_config=dict(cfg),
        )

    @classmethod
    def from_json_file(cls, path: str) -> ModelConfig:
        """Read `config.json`; raises ValueError on malformed JSON."""
        with open(path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(cfg)


def is_hf_folder(path: str) -> bool:
    """True when `path` is a folder holding an HF `config.json`."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
