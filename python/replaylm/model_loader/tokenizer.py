"""Tokenizer loading for every model-path kind the loader accepts."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.gguf_loader import load_gguf_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a model path, or None when the path holds none (a config-only folder
    used with dummy weights: such a model takes token ids only)."""
    path = resolve_model_path(path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(path)
    return None
