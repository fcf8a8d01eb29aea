"""Read llama.cpp GGUF checkpoints as HF-style configs and HF-named float32 weights (the
tokenizer: `gguf_tokenizer`).

Supported GGUF architectures: `llama` (Mixtral too: a `llama` file with `llama.expert_count`
set), `qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`. Quantized tensors are dequantized to float32 on
the device they load on (`gguf_dequant`). llama.cpp's converter permutes the rows of the Q and K
projections of `llama` models (HF rotate-half rope -> interleaved rope); the permutation is
undone here so every tensor comes out in the layout HF's modeling code expects.

Mixture-of-experts files stack each layer's experts into one tensor per projection
(`blk.N.ffn_gate_exps` [E, I, H] in torch order; `ffn_gate_up_exps` [E, 2I, H] when llama.cpp's
converter fused gate and up); each is dequantized once and handed out as per-expert views under
the names of the HF checkpoints (`mlp.experts.{e}.gate_proj`, Mixtral's
`block_sparse_moe.experts.{e}.w1`). Old Mixtral files keep one tensor per expert
(`blk.N.ffn_gate.{e}`), which map one to one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from gguf import Keys

from replaylm.model_loader.gguf_dequant import dequantize
from replaylm.model_loader.gguf_header import GGUFHeader, GGUFTensor, read_header

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
_SHARED_EXPERT_TENSORS = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
# stacked experts (torch order): `ffn_gate_exps` [E, I, H], `ffn_down_exps` [E, H, I],
# `ffn_gate_up_exps` [E, 2I, H]
_STACKED_EXPERTS_RE = re.compile(r"ffn_(gate|up|down|gate_up)_exps")
# one expert of an old (pre-stacking) Mixtral file
_ONE_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


@dataclass(frozen=True)
class _Layout:
    """How one GGUF architecture's tensors map to an HF model class.

    `moe`: the HF module of a layer's sparse MLP (None: a dense model); `experts`: the HF names
    of one expert's projections by GGUF projection (`gate`, `up`, `down`); `block_tensors`: the
    per-layer GGUF names beyond `_BLOCK_TENSORS` (router, shared expert)."""

    architecture: str
    model_type: str
    rope_permuted: bool = False
    moe: str | None = None
    experts: Mapping[str, str] = field(default_factory=dict)
    block_tensors: Mapping[str, str] = field(default_factory=dict)


_QWEN_EXPERTS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_LAYOUTS = {
    # llama.cpp's converter permutes the Q/K rows of `llama` files into interleaved-rope order
    "llama": _Layout("LlamaForCausalLM", "llama", rope_permuted=True),
    "qwen2": _Layout("Qwen2ForCausalLM", "qwen2"),
    "qwen3": _Layout("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": _Layout(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        moe="mlp",
        experts=_QWEN_EXPERTS,
        block_tensors={"ffn_gate_inp": "mlp.gate", **_SHARED_EXPERT_TENSORS},
    ),
    "qwen3moe": _Layout(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        moe="mlp",
        experts=_QWEN_EXPERTS,
        block_tensors={"ffn_gate_inp": "mlp.gate"},
    ),
}
# Mixtral: architecture `llama` with experts (HF w1 = gate, w3 = up, w2 = down)
_MIXTRAL = _Layout(
    "MixtralForCausalLM",
    "mixtral",
    rope_permuted=True,
    moe="block_sparse_moe",
    experts={"gate": "w1", "up": "w3", "down": "w2"},
    block_tensors={"ffn_gate_inp": "block_sparse_moe.gate"},
)


def read_gguf_config(path: str) -> dict[str, Any]:
    """HF-style config dict (as accepted by `ModelConfig.from_dict`) from the GGUF metadata.

    Raises ValueError for a non-GGUF file or an unsupported architecture / rope scaling.
    """
    header = read_header(path)
    arch = _architecture(header, path)
    layout = _layout(header, arch)
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
    config = {
        "architectures": [layout.architecture],
        "model_type": layout.model_type,
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
    if layout.moe is not None:
        config.update(_moe_config(path, arch, meta))
    return config


def iter_gguf_weights(
    path: str, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterator of `(hf_name, float32 tensor in HF shape)` over every tensor, one at a time, on
    `device` (default: the CPU); a stacked-experts tensor gives one view per expert.

    Each tensor's bytes go from the memory-mapped file to `device` as they are, to be
    dequantized there. A non-GGUF file or an unsupported architecture raises ValueError at call
    time; a tensor with no HF counterpart raises ValueError when reached.
    """
    header = read_header(path)
    arch = _architecture(header, path)
    layout = _layout(header, arch)
    # a required key: `read_gguf_config`, which reads the model's config first, needs it too
    heads = int(header.fields[Keys.Attention.HEAD_COUNT.format(arch=arch)])
    kv_heads = int(header.fields.get(Keys.Attention.HEAD_COUNT_KV.format(arch=arch), heads))
    rope_heads = {".attn_q.": heads, ".attn_k.": kv_heads} if layout.rope_permuted else {}
    target = device or torch.device("cpu")
    return (
        pair
        for tensor in header.tensors
        for pair in _hf_tensors(tensor, path, layout, rope_heads, target)
    )


def count_gguf_tensors(path: str) -> int:
    """Number of `(name, tensor)` pairs `iter_gguf_weights` yields (read from the already parsed
    header): one per tensor, one per expert of a stacked-experts tensor. ValueError, as the
    iterator, for a tensor with no HF counterpart."""
    header = read_header(path)
    layout = _layout(header, _architecture(header, path))
    return sum(len(_hf_names(t, path, layout)) for t in header.tensors)


def _architecture(header: GGUFHeader, path: str) -> str:
    """The file's `general.architecture`; ValueError unless it is one we map to HF."""
    arch = header.fields.get(Keys.General.ARCHITECTURE)
    if arch not in _LAYOUTS:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(_LAYOUTS))}"
        )
    return arch


def _layout(header: GGUFHeader, arch: str) -> _Layout:
    """The HF layout of a file of GGUF architecture `arch`: llama.cpp writes Mixtral as `llama`
    with `llama.expert_count` set."""
    if arch == "llama" and header.fields.get(Keys.LLM.EXPERT_COUNT.format(arch=arch)):
        return _MIXTRAL
    return _LAYOUTS[arch]


def _moe_config(path: str, arch: str, meta: Callable[..., Any]) -> dict[str, Any]:
    """The HF config keys of a mixture-of-experts model from `<arch>.expert_*`.

    Mixtral's experts are `intermediate_size` wide (`feed_forward_length`). For the Qwen MoE
    models the defaults and routing are those of llama.cpp, which runs these files: the expert
    width falls back to `feed_forward_length / expert_used_count`, the shared expert's to
    `feed_forward_length`; `qwen3moe` always renormalizes the top-k routing weights and
    `qwen2moe` never does; every layer is sparse (each has a router).
    """
    experts = meta(Keys.LLM.EXPERT_COUNT)
    used = meta(Keys.LLM.EXPERT_USED_COUNT)
    if not experts or not used:
        raise ValueError(f"{path}: {arch} file without '{arch}.expert_count/expert_used_count'")
    if arch == "llama":
        return {"num_local_experts": int(experts), "num_experts_per_tok": int(used)}
    ffn = int(meta(Keys.LLM.FEED_FORWARD_LENGTH))
    config: dict[str, Any] = {
        "num_experts": int(experts),
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) or ffn // used),
        "norm_topk_prob": arch == "qwen3moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        shared = meta(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
        config["shared_expert_intermediate_size"] = int(shared or ffn)
    return config


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


def _hf_tensors(
    tensor: GGUFTensor,
    path: str,
    layout: _Layout,
    rope_heads: dict[str, int],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize one tensor to float32 in HF shape on `device`, undoing the Q/K rope permute
    when asked, and hand it out under its HF name; a stacked-experts tensor goes out as views,
    one per expert. `rope_heads` maps a name fragment (`.attn_q.`) to the head count its rows
    were permuted with."""
    names = _hf_names(tensor, path, layout)
    shape = tuple(reversed(tensor.shape))  # GGUF lists dims innermost-first
    weight = dequantize(torch.from_numpy(tensor.data), tensor.qtype, shape, device)
    for fragment, n_heads in rope_heads.items():
        if fragment in tensor.name:
            weight = _unpermute_rope_rows(weight, n_heads)
    if len(names) == 1:
        yield names[0], _as_hf_shape(tensor.name, weight)
        return
    # [E, I, H] -> E views; a fused [E, 2I, H] -> 2E: each expert's gate, then its up
    yield from zip(names, weight.reshape(len(names), -1, shape[-1]).unbind(0), strict=True)


def _as_hf_shape(gguf_name: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight`, with the shared-expert gate as HF's [1, H] row: quantized Qwen2-MoE files hold
    it as a vector [H]."""
    if gguf_name.endswith(".ffn_gate_inp_shexp.weight") and weight.dim() == 1:
        return weight.unsqueeze(0)
    return weight


def _hf_names(tensor: GGUFTensor, path: str, layout: _Layout) -> list[str]:
    """HF parameter names of a GGUF tensor, in the order its pieces are handed out (one name but
    for stacked experts); ValueError for tensors with no HF counterpart."""
    name = tensor.name
    if layout.moe is not None and (m := _ONE_EXPERT_RE.fullmatch(name)):
        layer, proj, expert = m.groups()
        return [_expert_name(layout, layer, int(expert), proj)]
    if m := _BLOCK_RE.fullmatch(name):
        layer, base, suffix = m.groups()
        stacked = _STACKED_EXPERTS_RE.fullmatch(base)
        if layout.moe is not None and stacked and suffix == "weight":
            projs = ("gate", "up") if stacked.group(1) == "gate_up" else (stacked.group(1),)
            n_experts = tensor.shape[-1]  # the outermost dimension
            return [_expert_name(layout, layer, e, p) for e in range(n_experts) for p in projs]
        hf = layout.block_tensors.get(base) or _BLOCK_TENSORS.get(base)
        if hf is not None:
            return [f"model.layers.{layer}.{hf}.{suffix}"]
    elif (m := _GLOBAL_RE.fullmatch(name)) and m.group(1) in _GLOBAL_TENSORS:
        return [f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"]
    raise ValueError(f"{path}: GGUF tensor {name!r} has no HF counterpart")


def _expert_name(layout: _Layout, layer: str, expert: int, proj: str) -> str:
    """HF name of projection `proj` (GGUF's `gate`, `up` or `down`) of one expert."""
    return f"model.layers.{layer}.{layout.moe}.experts.{expert}.{layout.experts[proj]}.weight"


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (weight or bias) back to HF rotate-half order.

    llama.cpp views each head's rows as (2, head_dim/2) and swaps the axes, interleaving the two
    rotate-half halves; swapping (head_dim/2, 2) back restores HF's row order.
    """
    half = weight.shape[0] // n_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)
