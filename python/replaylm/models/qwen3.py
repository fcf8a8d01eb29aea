"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (and optional QKV bias)."""

from __future__ import annotations

from replaylm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def uses_qk_norm() -> bool:
        return True
