"""Rotary position embedding (neox / rotate-half layout, as HF Llama and Qwen use).

Supported scaling (`rope_scaling["rope_type"]`): none, `linear`, `llama3` (Llama 3.1+).
The frequency formulas follow HF transformers so that logits match it to float32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert scaling is not None  # a rope_type other than default comes from `scaling`
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope scaling type '{rope_type}'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Applies rope to q `[T, H*D]` and k `[T, Hkv*D]` at `positions` `[T]`.

    The cos/sin table `[max_positions, rotary_dim]` is built once, in float32. This is the
    torch code; on the Triton route the model runs kernels/qk_norm_rope.py with these tables.
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        freqs = torch.outer(torch.arange(max_positions).float(), _inv_freq(head_dim, base, scaling))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rotated * sin).view(t, -1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
