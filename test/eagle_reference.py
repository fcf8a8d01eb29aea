"""A reference EAGLE / EAGLE-3 drafter, written from the heads' published architecture and fed
the target's hidden states as transformers computes them (float32, whole sequences)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

LAYER_IDS = [0, 1, 2]  # the test heads' EAGLE-3 layers: the inputs of target layers 1, 2 and 3


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_head(kind, t, hf, tokens, features):
    """The head over a whole sequence (causal): logits and output feature of its last position.
    `features`: the head's inputs (EAGLE-3's already through fc)."""
    cfg = hf.config
    eps, heads, kv_heads = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    p = "layers.0." if kind == "eagle" else "midlayer."
    embed = hf.model.embed_tokens.weight[torch.tensor(tokens)]
    if kind == "eagle":
        x = F.linear(torch.cat([embed, features], -1), t["fc.weight"], t["fc.bias"])
        residual = attn_in = x
    else:
        residual = features
        attn_in = torch.cat(
            [
                _rms(embed, t[p + "input_layernorm.weight"], eps),
                _rms(features, t[p + "hidden_norm.weight"], eps),
            ],
            -1,
        )
    n, d = len(tokens), cfg.hidden_size // heads
    q = F.linear(attn_in, t[p + "self_attn.q_proj.weight"]).view(1, n, heads, d).transpose(1, 2)
    k = F.linear(attn_in, t[p + "self_attn.k_proj.weight"]).view(1, n, kv_heads, d).transpose(1, 2)
    v = F.linear(attn_in, t[p + "self_attn.v_proj.weight"]).view(1, n, kv_heads, d).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(cfg)(v, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = F.linear(attn.transpose(1, 2).reshape(n, -1), t[p + "self_attn.o_proj.weight"]) + residual
    x = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
    gate, up = (F.linear(x, t[f"{p}mlp.{name}_proj.weight"]) for name in ("gate", "up"))
    out = F.linear(F.silu(gate) * up, t[p + "mlp.down_proj.weight"]) + h
    if kind == "eagle":
        logits = F.linear(out, hf.lm_head.weight)
    else:
        logits = F.linear(_rms(out, t["norm.weight"], eps), t["lm_head.weight"])
    return logits[-1], out[-1]


@torch.no_grad()
def reference_drafts(kind, tensors, hf, ids: list[int], steps: int) -> list[int]:
    """The head's greedy chain after `ids`, from the target's hidden states as transformers
    computes them (the final-norm output, or the inputs of LAYER_IDS + 1)."""
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    if kind == "eagle":
        features = hidden[-1][0, :-1]
    else:
        fused = torch.cat([hidden[i + 1][0, :-1] for i in LAYER_IDS], -1)
        features = F.linear(fused, tensors["fc.weight"])
    tokens, drafts = list(ids[1:]), []
    for _ in range(steps):
        logits, out = _reference_head(kind, tensors, hf, tokens, features)
        draft = int(logits.argmax())
        if kind == "eagle3":
            draft += int(tensors["d2t"][draft])
        drafts.append(draft)
        tokens.append(draft)
        features = torch.cat([features, out[None]])
    return drafts
