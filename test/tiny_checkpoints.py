"""Tiny random HF checkpoints (config.json + safetensors) written by tests, one per architecture.

Weights are drawn with a larger spread than HF's default init so that logits vary strongly with
every input and every weight: a wrong rope, mask or bias shows up far above float32 rounding.

`write_fp8_checkpoint` writes one of them in an FP8 checkpoint layout (`FP8_LAYOUTS`), quantized
here the way those checkpoints are (independently of replaylm's own quantization code).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
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


# FP8 checkpoints' shapes (test_fp8_checkpoints): every dimension of the first whole 128-blocks
# or ragged (hidden 160: two blocks, the last of 32), q, k, v and gate, up of whole blocks
TINY_FP8_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama3_blocks": (
        LlamaConfig,
        dict(
            _LLAMA3_ROPE,
            hidden_size=160,
            intermediate_size=256,
            num_key_value_heads=4,
            head_dim=32,
        ),
    ),
}


def write_tiny_checkpoint(kind: str, folder: Path, seed: int = 0) -> PreTrainedModel:
    """Write a random `kind` checkpoint (of TINY_CONFIGS, TINY_MOE_CONFIGS, TINY_SERVED_CONFIGS
    or TINY_FP8_CONFIGS) to `folder`; return the HF model (float32, eval)."""
    config_cls, overrides = {
        **TINY_CONFIGS,
        **TINY_MOE_CONFIGS,
        **TINY_SERVED_CONFIGS,
        **TINY_FP8_CONFIGS,
    }[kind]
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


E4M3_MAX = 448.0
_COMPRESSED_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}


def _compressed_static(weights: str) -> dict:
    """compressed-tensors' quantization_config of FP8 weights per `weights` (tensor or channel)
    with static per-tensor input scales."""
    fp8 = {**_COMPRESSED_FP8, "dynamic": False}
    group = {
        "targets": ["Linear"],
        "weights": {**fp8, "strategy": weights},
        "input_activations": {**fp8, "strategy": "tensor"},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["re:.*lm_head"],
    }


# quantization_config of each FP8 layout, and how its weight scales are stored: the scale
# tensor's name suffix and granularity
FP8_LAYOUTS: dict[str, tuple[dict, str, str]] = {
    # DeepSeek-V3, Qwen3-*-FP8: 128x128 blocks, `weight_scale_inv`, dynamic activations
    "fp8_block": (
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        "weight_scale_inv",
        "block",
    ),
    # AutoFP8's: a `weight_scale` `[]` per tensor, static `input_scale` `[]`
    "fp8_tensor_static": (
        {"quant_method": "fp8", "activation_scheme": "static"},
        "weight_scale",
        "tensor",
    ),
    # llm-compressor's FP8_DYNAMIC: `weight_scale` `[N, 1]`, dynamic per-token activations
    "ct_channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**_COMPRESSED_FP8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**_COMPRESSED_FP8, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        },
        "weight_scale",
        "channel",
    ),
    # llm-compressor's FP8 (static): `weight_scale` `[1]` per tensor, `input_scale` `[1]`
    "ct_tensor_static": (_compressed_static("tensor"), "weight_scale", "tensor"),
    # the same with `weight_scale` `[N, 1]` per channel
    "ct_channel_static": (_compressed_static("channel"), "weight_scale", "channel"),
}
# the linear weights FP8 checkpoints quantize: attention, dense and expert MLPs (not the routers,
# the embedding or the LM head)
QUANTIZED_WEIGHT = re.compile(r".+\.(q|k|v|o|gate|up|down)_proj\.weight")
# the projections that share their input: a fused layer's, whose static input scale is the
# largest of theirs
_SIBLINGS = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}


def fp8_quantize(
    w: torch.Tensor, scales: str, block: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`w` `[N, K]` as FP8 checkpoints store it: (e4m3 values, float32 scales, the dequantized
    weight). Scales per tensor `[]`, per channel `[N, 1]`, or per `block` (`[ceil(N/bn),
    ceil(K/bk)]`, the last row and column of blocks ragged), each the amax over 448."""
    w = w.float()
    if scales == "tensor":
        scale = w.abs().max() / E4M3_MAX
        full = scale.expand(w.shape)
    elif scales == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        full = scale.expand(w.shape)
    else:
        assert block is not None
        bn, bk = block
        rows, cols = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
        scale = torch.empty(rows, cols)
        full = torch.empty_like(w)
        for i in range(rows):
            for j in range(cols):
                part = (slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk))
                scale[i, j] = w[part].abs().max() / E4M3_MAX
                full[part] = scale[i, j]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _calibrate(model: PreTrainedModel, vocab: int) -> dict[str, float]:
    """Static input scales: each quantized linear's largest input over a random batch, / 448."""
    amax: dict[str, float] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda mod, args, name=name: amax.__setitem__(name, float(args[0].abs().max()))
        )
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and QUANTIZED_WEIGHT.fullmatch(f"{name}.weight")
    ]
    with torch.no_grad():
        model(torch.randint(3, vocab, (2, 48), generator=torch.Generator().manual_seed(7)))
    for hook in hooks:
        hook.remove()
    return {name: value / E4M3_MAX for name, value in amax.items()}


def write_fp8_checkpoint(
    kind: str,
    folder: Path,
    layout: str,
    block_size: list[int] | None = None,
    ignore: tuple[str, ...] = (),
) -> tuple[PreTrainedModel, dict[str, float]]:
    """Write the random `kind` checkpoint to `folder` in FP8 `layout` (of FP8_LAYOUTS; its
    block size replaced by `block_size`), the modules named in `ignore` left unquantized (and
    listed in the config). Returns the reference: the same model with every quantized weight
    dequantized (float32, eager attention and experts), and the static input scale each
    quantized module's input takes (the largest of its fused layer's; empty when dynamic).
    Static scales are calibrated on the float model (per-expert ones are not written: dense
    layouts only); k's and gate's are raised by a quarter, so a fused layer's largest differs
    from its other shards'."""
    quant, scale_suffix, scales = FP8_LAYOUTS[layout]
    quant = json.loads(json.dumps(quant))
    block = None
    if scales == "block":
        quant["weight_block_size"] = block_size or quant["weight_block_size"]
        block = tuple(quant["weight_block_size"])
    if ignore:
        key = "ignore" if quant["quant_method"] == "compressed-tensors" else "ignored_layers"
        quant[key] = [*quant.get(key, []), *ignore]
    static = layout.endswith("_static")
    float_folder = folder.with_name(folder.name + "_dequantized")
    model = write_tiny_checkpoint(kind, float_folder)
    inputs = _calibrate(model, model.config.vocab_size) if static else {}
    tensors = load_file(str(float_folder / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not QUANTIZED_WEIGHT.fullmatch(name) or module in ignore:
            fp8[name] = tensor
            continue
        q, scale, tensors[name] = fp8_quantize(tensor, scales, block)
        fp8[name] = q
        compressed = quant["quant_method"] == "compressed-tensors"
        fp8[f"{module}.{scale_suffix}"] = (
            scale.reshape(1) if compressed and not scale.dim() else scale
        )
        if static:
            bump = 1.25 if module.endswith((".k_proj", ".gate_proj")) else 1.0
            inputs[module] *= bump
            fp8[f"{module}.input_scale"] = torch.tensor(inputs[module]).reshape(
                (1,) if compressed else ()
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in fp8.items()}, str(folder / "model.safetensors"))
    config = json.loads((float_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    save_file(tensors, str(float_folder / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(
        float_folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    shutil.rmtree(float_folder)
    return eager_experts(reference), _largest_of_siblings(inputs)


def eager_experts(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with its experts (if any) run by transformers' eager loop, which calls
    F.linear per expert (a test can see each expert's inputs there), not grouped matmuls."""
    if any(name.endswith(".experts") for name, _ in model.named_modules()):
        model.set_experts_implementation("eager")
    return model


def _largest_of_siblings(inputs: dict[str, float]) -> dict[str, float]:
    """Each module's static input scale as its fused layer takes it: the largest of the
    projections that share its input."""

    def group(name: str) -> str:
        parent, _, proj = name.rpartition(".")
        return f"{parent}.{_SIBLINGS.get(proj.removesuffix('_proj'), proj)}"

    largest: dict[str, float] = {}
    for name, value in inputs.items():
        largest[group(name)] = max(largest.get(group(name), 0.0), value)
    return {name: largest[group(name)] for name in inputs}
