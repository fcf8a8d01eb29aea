"""Read llama.cpp GGUF checkpoints as HF-style configs and HF-named float32 weights (the
tokenizer: `gguf_tokenizer`).

Supported GGUF architectures: `llama`, `qwen2`, `qwen3`. Quantized tensors are dequantized to
float32 on the device they load on (`gguf_dequant`). llama.cpp's converter permutes the rows of
the Q and K projections of `llama` models (HF rotate-half rope -> interleaved rope); the
permutation is undone here so every tensor comes out in the layout HF's modeling code expects.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from gguf import Keys

from replaylm.model_loader.gguf_dequant import dequantize
from replaylm.model_loader.gguf_header import GGUFHeader, GGUFTensor, read_header

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose Q/K rows llama.cpp's converter permutes into interleaved-rope order.
_ROPE_PERMUTED = {"llama"}
_HF_ROPE_SCALING_KEYS = {
    Keys.Rope.SCALING_FACTOR: "factor",
    Keys.Rope.SCALING_ORIG_CTX_LEN: "original_max_position_embeddings",
    Keys.Rope.SCALING_ATTN_FACTOR: "attention_factor",
    Keys.Rope.SCALING_YARN_BETA_FAST: "beta_fast",
    Keys.Rope.SCALING_YARN_BETA_SLOW: "beta_slow",
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def read_gguf_config(path: str) -> dict[str, Any]:
    """HF-style config dict (as accepted by `ModelConfig.from_dict`) from the GGUF metadata.

    Raises ValueError for a non-GGUF file or an unsupported architecture / rope scaling.
    """
    header = read_header(path)
    arch = _architecture(header, path)
    tensor_names = {t.name for t in header.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path}: has a 'rope_freqs' tensor (llama3-style rope scaling baked into per-dim "
            f"frequency factors), which replaylm does not support"
        )

    def meta(key: str, default: Any = None) -> Any:
        return header.fields.get(key.format(arch=arch), default)

    hidden = int(meta(Keys.LLM.EMBEDDING_LENGTH))
    heads = int(meta(Keys.Attention.HEAD_COUNT))
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    vocab = embd.shape[-1] if embd is not None else meta(Keys.LLM.VOCAB_SIZE)
    if vocab is None:
        raise ValueError(f"{path}: no 'token_embd.weight' tensor and no '{arch}.vocab_size' key")
    head_dim = meta(Keys.Attention.KEY_LENGTH) or meta(Keys.Rope.DIMENSION_COUNT)
    eos_ids = [
        meta(k) for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
    ]
    eos_ids = list(dict.fromkeys(int(i) for i in eos_ids if i is not None))
    bos = meta(Keys.Tokenizer.BOS_ID)
    return {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta(Keys.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(meta(Keys.LLM.BLOCK_COUNT)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(Keys.Attention.HEAD_COUNT_KV, heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(meta(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        "rope_theta": float(meta(Keys.Rope.FREQ_BASE, 10000.0)),
        "rope_scaling": _rope_scaling(path, meta),
        "max_position_embeddings": int(meta(Keys.LLM.CONTEXT_LENGTH, 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
    }


def iter_gguf_weights(
    path: str, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterator of `(hf_name, float32 tensor in HF shape)` over every tensor, one at a time, on
    `device` (default: the CPU).

    Each tensor's bytes go from the memory-mapped file to `device` as they are, to be
    dequantized there. A non-GGUF file or an unsupported architecture raises ValueError at call
    time; a tensor with no HF counterpart raises ValueError when reached.
    """
    header = read_header(path)
    arch = _architecture(header, path)
    # a required key: `read_gguf_config`, which reads the model's config first, needs it too
    heads = int(header.fields[Keys.Attention.HEAD_COUNT.format(arch=arch)])
    kv_heads = int(header.fields.get(Keys.Attention.HEAD_COUNT_KV.format(arch=arch), heads))
    rope_heads = {".attn_q.": heads, ".attn_k.": kv_heads} if arch in _ROPE_PERMUTED else {}
    target = device or torch.device("cpu")
    return (_hf_tensor(tensor, path, rope_heads, target) for tensor in header.tensors)


def count_gguf_tensors(path: str) -> int:
    """Number of tensors in the file (read from its already parsed header)."""
    return len(read_header(path).tensors)


def _architecture(header: GGUFHeader, path: str) -> str:
    """The file's `general.architecture`; ValueError unless it is one we map to HF."""
    arch = header.fields.get(Keys.General.ARCHITECTURE)
    if arch not in _HF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(_HF_ARCHITECTURES))}"
        )
    return arch


def _rope_scaling(path: str, meta: Callable[..., Any]) -> dict[str, Any] | None:
    """HF `rope_scaling` from `<arch>.rope.scaling.*`; None when absent or 'none'."""
    kind = meta(Keys.Rope.SCALING_TYPE)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{path}: unsupported rope scaling type {kind!r}; supported: linear, yarn")
    scaling: dict[str, Any] = {"rope_type": kind}
    for key, hf_key in _HF_ROPE_SCALING_KEYS.items():
        value = meta(key)
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _hf_tensor(
    tensor: GGUFTensor, path: str, rope_heads: dict[str, int], device: torch.device
) -> tuple[str, torch.Tensor]:
    """Dequantize one tensor to float32 in HF shape on `device`, undoing the Q/K rope permute
    when asked. `rope_heads` maps a name fragment (`.attn_q.`) to the head count its rows were
    permuted with."""
    name = _hf_name(tensor.name, path)
    shape = tuple(reversed(tensor.shape))  # GGUF lists dims innermost-first
    weight = dequantize(torch.from_numpy(tensor.data), tensor.qtype, shape, device)
    for fragment, n_heads in rope_heads.items():
        if fragment in tensor.name:
            weight = _unpermute_rope_rows(weight, n_heads)
    return name, weight


def _hf_name(gguf_name: str, path: str) -> str:
    """HF parameter name of a GGUF tensor; ValueError for tensors with no HF counterpart."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, base, suffix = m.groups()
        if base in _BLOCK_TENSORS:
            return f"model.layers.{layer}.{_BLOCK_TENSORS[base]}.{suffix}"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"{path}: GGUF tensor {gguf_name!r} has no HF counterpart")


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (weight or bias) back to HF rotate-half order.

    llama.cpp views each head's rows as (2, head_dim/2) and swaps the axes, interleaving the two
    rotate-half halves; swapping (head_dim/2, 2) back restores HF's row order.
    """
    half = weight.shape[0] // n_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)
