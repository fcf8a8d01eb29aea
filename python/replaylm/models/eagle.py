"""EAGLE and EAGLE-3 draft heads: one decoder layer over the target model's hidden states.

A head is run as a model of its own (its own KV cache, batches and CUDA graphs), but each
token's input is a pair: the token, and a feature. A head's position p reads the token the
target produced at p + 1 and the target's feature at p (its hidden state there, which the
target wrote into a `FeatureStore`), and predicts the token at p + 2; a draft step past the
target's tokens reads the head's own output at the step before instead of a target feature.
The features come through the head's `features` buffer, written by the drafter before each
forward (`speculative/eagle.py`), which every graph reads at a fixed address; `compute_logits`
writes each request's output feature back into its first rows, in request order, for the next
draft step.

- EAGLE (`LlamaForCausalLMEagle`): `fc(cat(embed, feature))` (2H -> H) into a decoder layer
  without an input norm; its output (no final norm) is the next feature and goes straight to the
  target's LM head. Features are the target's final-norm hidden states.
- EAGLE-3 (`LlamaForCausalLMEagle3`): the target's residual stream entering three layers
  (`eagle_config.eagle_aux_hidden_state_layer_ids` + 1, default 2, L/2 and L-3), concatenated,
  through `fc` (3H -> H, applied by the drafter as it gathers them); the layer attends over
  `cat(input_layernorm(embed), hidden_norm(feature))` (2H); the pre-norm output is the next
  feature, and the final norm and the head's own LM head over a smaller draft vocabulary give
  the logits; `d2t` maps a draft id d to the target id d + d2t[d].

Both take the target's embedding (and EAGLE its LM head) at start (`attach_target`), as SGLang
does; checkpoint tensors of those names are skipped. Checkpoint names are the published heads':
no `model.` prefix, EAGLE's layer as `layers.0.*`, EAGLE-3's as `midlayer.*`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from replaylm.distributed.parallel_state import tp_place
from replaylm.layers.layernorm import RMSNorm
from replaylm.layers.linear import Linear
from replaylm.layers.logits_processor import LMHead, LogitsProcessor
from replaylm.layers.rotary_embedding import RotaryEmbedding
from replaylm.models.config import ModelConfig
from replaylm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from replaylm.model_executor.forward_batch import ForwardBatch


def eagle3_layers(head: ModelConfig, target_layers: int) -> list[int]:
    """The target layers whose input an EAGLE-3 head reads: its config's
    `eagle_aux_hidden_state_layer_ids` (layer outputs, so the next layers' inputs), else
    SGLang's default."""
    eagle = head.hf_config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [2, target_layers // 2, target_layers - 3]
    return [int(i) + 1 for i in ids]


class EagleHead(LlamaForCausalLM):
    """What both heads share: the rope, the features buffer, the target's embedding, the
    checkpoint's names and `compute_logits` keeping each request's output feature. It reads
    the target's final-norm hidden states unless a head says otherwise."""

    algorithm: str  # its --speculative-algorithm
    architecture: str  # its config's `architectures[0]`
    features: torch.Tensor
    target_embed: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        if tp_place().size != 1:
            raise ValueError("an EAGLE head runs at tensor-parallel size 1")
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.logits_processor = LogitsProcessor()
        self.lm_head: LMHead | None = None

    @property
    def feature_width(self) -> int:
        """Values per token of the target's features it reads."""
        return self.config.hidden_size

    def target_feature_layers(self, target_layers: int) -> list[int] | None:
        """The target layers whose input it reads (None: the target's final-norm output)."""
        return None

    def attach_target(self, target: LlamaForCausalLM, rows: int) -> None:
        """Take `target`'s embedding (and what else the head shares) and make the features
        buffer of `rows` tokens (the most any forward of the head runs)."""
        weight = target.model.embed_tokens.weight
        self.register_buffer("target_embed", weight, persistent=False)
        self.register_buffer(
            "features", weight.new_zeros(rows, self.config.hidden_size), persistent=False
        )

    def project_target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features `[N, feature_width]` as the head's inputs `[N, H]`."""
        return features

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def compute_logits(
        self, hidden: torch.Tensor, batch: ForwardBatch, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each request's logits, its output feature kept in `features` (request order)."""
        last = self.logits_processor.select(hidden, batch)
        self.features[: last.shape[0]].copy_(last)
        return self.logits_processor.project(self.output_norm(last), self.lm_head_weight, out)

    def output_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.target_embed)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The published head's tensors: the target's embedding (and LM head, which EAGLE
        shares) skipped, `d2t` kept as offsets, `t2d` dropped (d2t says it all)."""
        kept = []
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if self._skipped(name):
                continue
            kept.append((self._rename(name), tensor))
        super().load_weights(kept)

    def _skipped(self, name: str) -> bool:
        return name.startswith("embed_tokens.") or name == "t2d"

    def _rename(self, name: str) -> str:
        return name


class LlamaEagleHead(EagleHead):
    """EAGLE: `fc(cat(embed, feature))`, a decoder layer without an input norm, the target's
    LM head."""

    algorithm, architecture = "eagle", "LlamaForCausalLMEagle"
    target_lm_head: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        place = tp_place()
        self.fc = Linear(2 * h, h, bias=bool(config.hf_config.get("bias", True)))
        self.self_attn = LlamaAttention(config, 0, self.rotary, config.attention_bias, False, place)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(h, config.intermediate_size, place)

    def attach_target(self, target: LlamaForCausalLM, rows: int) -> None:
        super().attach_target(target, rows)
        self.register_buffer("target_lm_head", target.lm_head_weight, persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target_lm_head

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        """The layer's output (pre-norm: residual included) of every token, `[T, H]`."""
        features = self.features[: input_ids.shape[0]]
        hidden = self.fc(torch.cat([self._embed(input_ids), features], dim=-1))
        residual = hidden
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) + residual

    def _skipped(self, name: str) -> bool:
        return super()._skipped(name) or name == "lm_head.weight"

    def _rename(self, name: str) -> str:
        return name.removeprefix("layers.0.")


class LlamaEagle3Head(EagleHead):
    """EAGLE-3: the fused three-layer feature through `fc`, a layer attending over the
    normed embedding and feature side by side, a final norm and a draft-vocabulary LM head."""

    algorithm, architecture = "eagle3", "LlamaForCausalLMEagle3"
    d2t: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        place = tp_place()
        target_h = int(config.hf_config.get("target_hidden_size") or h)
        self.draft_vocab_size = int(config.hf_config.get("draft_vocab_size") or config.vocab_size)
        self.fc = Linear(3 * target_h, h)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, 0, self.rotary, config.attention_bias, False, place, input_size=2 * h
        )
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(h, config.intermediate_size, place)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = LMHead(self.draft_vocab_size, h)
        # the identity map until a checkpoint's d2t says otherwise
        self.register_buffer(
            "d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False
        )

    @property
    def feature_width(self) -> int:
        return self.fc.input_size

    @property
    def logits_width(self) -> int:
        return self.draft_vocab_size

    def target_feature_layers(self, target_layers: int) -> list[int] | None:
        return eagle3_layers(self.config, target_layers)

    def project_target_features(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def output_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        """The layer's pre-norm output (residual included) of every token, `[T, H]`."""
        features = self.features[: input_ids.shape[0]]
        embeds = self.input_layernorm(self._embed(input_ids))
        hidden = torch.cat([embeds, self.hidden_norm(features)], dim=-1)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, features)
        return self.mlp(hidden) + residual

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        rest = []
        for name, tensor in weights:
            if name.removeprefix("model.") == "d2t":
                self.d2t.copy_(tensor.to(torch.int64))
            else:
                rest.append((name, tensor))
        super().load_weights(rest)

    def _rename(self, name: str) -> str:
        return name.removeprefix("midlayer.")


# the heads by --speculative-algorithm
EAGLE_HEADS: dict[str, type[EagleHead]] = {
    head.algorithm: head for head in (LlamaEagleHead, LlamaEagle3Head)
}
