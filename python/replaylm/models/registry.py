"""Model classes by HF architecture name (`config.json` -> `architectures[0]`)."""

from __future__ import annotations

from replaylm.models.eagle import EAGLE_HEADS
from replaylm.models.llama import LlamaForCausalLM
from replaylm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from replaylm.models.qwen2 import Qwen2ForCausalLM
from replaylm.models.qwen3 import Qwen3ForCausalLM

# every architecture is a LlamaForCausalLM variant, so the engine types its model as one
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    # EAGLE draft heads (--speculative-algorithm eagle / eagle3 only)
    **{head.architecture: head for head in EAGLE_HEADS.values()},
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for an architecture; ValueError names it and lists the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported architecture '{architecture}'; supported: {supported}"
        ) from None
