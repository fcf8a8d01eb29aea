"""Qwen2 / Qwen2.5: the Llama decoder with biases on the QKV projection."""

from __future__ import annotations

from replaylm.models.config import ModelConfig
from replaylm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def uses_qkv_bias(config: ModelConfig) -> bool:
        return True
