"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral. Each is the Llama decoder
(Qwen3-MoE with Qwen3's q/k norm, Qwen2-MoE with QKV biases) whose MLP, in its sparse layers,
is a `SparseMoeBlock` (Qwen2-MoE's with a shared expert); its other layers keep the dense MLP.

The routing facts come from the config (`MoeSpec`, each family's keys). Checkpoints hold the
experts either one tensor per expert and projection, the hub's layout
(`mlp.experts.{e}.{gate,up,down}_proj.weight`; Mixtral's `block_sparse_moe.experts.{e}.w1`,
`w3`, `w2`), or stacked as transformers >= 5 holds them (`mlp.experts.gate_up_proj` `[E, 2I, H]`,
`mlp.experts.down_proj` `[E, H, I]`). The router is `mlp.gate` (`block_sparse_moe.gate`).

Under expert parallelism each rank holds its share of every sparse layer's experts, whole, and
reads only those experts' tensors (`FusedMoE`); attention, the dense layers, the router and
the shared expert are split as under plain tensor parallelism.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from replaylm.distributed.parallel_state import TPPlace
from replaylm.distributed.sharding import MLP_COLUMNS, split_evenly
from replaylm.layers.moe.layer import (
    EXPERT_COLUMNS,
    EXPERTS,
    ExpertPiece,
    FusedMoE,
    SharedExpertMoeBlock,
    SparseMoeBlock,
)
from replaylm.layers.moe.routing import LiveTokens
from replaylm.layers.quantization.config import Fp8Config
from replaylm.models.config import ModelConfig
from replaylm.models.llama import LlamaForCausalLM, LlamaMLP, Piece
from replaylm.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from replaylm.model_executor.forward_batch import ForwardBatch

# `<layer>.mlp.experts.<e>.<gate|up|down>_proj.<weight|weight_scale|input_scale>`: one
# expert's projection, or its FP8 scales
_EXPERT_TENSOR = re.compile(
    r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale|input_scale)"
)
# transformers' stacked expert tensors -> FusedMoE's parameters
_STACKED_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
# Mixtral's expert projection names -> the common ones
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts model's routing: `num_experts` experts of `expert_size`
    intermediate columns, `top_k` per token (their weights renormalised to sum to 1 with
    `renormalize`), in the layers `sparse_layers`; `shared_expert_size`: the intermediate size
    of the shared expert every token also takes (Qwen2-MoE), None without one."""

    num_experts: int
    top_k: int
    expert_size: int
    renormalize: bool
    sparse_layers: frozenset[int]
    shared_expert_size: int | None = None

    def block(
        self, hidden_size: int, place: TPPlace, quant: Fp8Config | None = None
    ) -> SparseMoeBlock:
        """A sparse layer's MLP, for this process's tensor-parallel `place`; `quant`: FP8
        experts (and shared expert). The router and the shared expert's gate stay in the
        model's dtype, as FP8 checkpoints hold them."""
        experts = FusedMoE(
            self.num_experts,
            hidden_size,
            self.expert_size,
            self.top_k,
            self.renormalize,
            place,
            quant,
        )
        if self.shared_expert_size is None:
            return SparseMoeBlock(hidden_size, experts)
        shared = LlamaMLP(hidden_size, self.shared_expert_size, place, quant)
        return SharedExpertMoeBlock(hidden_size, experts, shared)


def _required(hf: dict[str, Any], key: str, *aliases: str) -> int:
    """The config's integer `key` (or the first of its `aliases` present); ValueError naming
    `key` when none is."""
    for name in (key, *aliases):
        if name in hf:
            return int(hf[name])
    raise ValueError(f"config is missing required key '{key}'")


def _qwen_moe_spec(config: ModelConfig, shared_expert: bool) -> MoeSpec:
    """Qwen2-MoE's (`shared_expert`) and Qwen3-MoE's keys: a layer is sparse unless it is in
    `mlp_only_layers` or its number (from 1) is not a multiple of `decoder_sparse_step`."""
    hf = config.hf_config
    # transformers >= 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`
    num_experts = _required(hf, "num_experts", "num_local_experts")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = frozenset(
        i
        for i in range(config.num_hidden_layers)
        if num_experts > 0 and i not in dense and (i + 1) % step == 0
    )
    return MoeSpec(
        num_experts=num_experts,
        top_k=_required(hf, "num_experts_per_tok"),
        expert_size=_required(hf, "moe_intermediate_size"),
        renormalize=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_size=(
            _required(hf, "shared_expert_intermediate_size") if shared_expert else None
        ),
    )


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder with the sparse block of `moe_spec` in its sparse layers; loads the
    experts' tensors in either layout (the module docstring's). `live_tokens`: which rows its
    sparse layers count, set before each forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.live_tokens = LiveTokens()
        for experts in self.modules():
            if isinstance(experts, FusedMoE):
                experts.live = self.live_tokens

    @staticmethod
    def moe_spec(config: ModelConfig) -> MoeSpec:
        """The family's routing facts, read from `config`."""
        raise NotImplementedError

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        """The Llama decoder's, after telling its sparse layers which rows are live tokens,
        by the batch's KV slots, so that they leave a CUDA graph's padding rows out of their
        token counts (under torch.compile, `batch` None, they read the attention_context's
        batch instead)."""
        if batch is not None:
            self.live_tokens.slots = batch.out_cache_loc
        return super().forward_hidden(input_ids, positions, batch)

    def make_mlp(self, layer_id: int, place: TPPlace) -> nn.Module:
        spec = self.moe_spec(self.config)
        if layer_id in spec.sparse_layers:
            return spec.block(self.config.hidden_size, place, self.config.quantization)
        return super().make_mlp(layer_id, place)

    @staticmethod
    def _map_name(ckpt_name: str) -> tuple[str, Piece]:
        """An expert's projection -> (its FusedMoE parameter, the piece); a stacked expert
        tensor -> the whole parameter; any other name as the Llama decoder maps it."""
        expert = _EXPERT_TENSOR.fullmatch(ckpt_name)
        if expert is not None:
            experts, index, proj, leaf = expert.groups()
            param = f"{'w2' if proj == 'down' else 'w13'}_{leaf}"
            return f"{experts}.{param}", ExpertPiece(int(index), proj)
        module, _, leaf = ckpt_name.rpartition(".")
        if module.endswith(".mlp.experts") and leaf in _STACKED_TENSORS:
            return f"{module}.{_STACKED_TENSORS[leaf]}", None
        return LlamaForCausalLM._map_name(ckpt_name)

    def checkpoint_names(self, module_name: str) -> list[str]:
        """A FusedMoE's: its experts' projections, as the hub's checkpoints name them."""
        if not module_name.endswith(".mlp.experts"):
            return super().checkpoint_names(module_name)
        experts = range(self.moe_spec(self.config).num_experts)
        return [f"{module_name}.{e}.{p}_proj" for e in experts for p in ("gate", "up", "down")]


class Qwen3MoeForCausalLM(MoeForCausalLM, Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norm), routed experts."""

    @staticmethod
    def moe_spec(config: ModelConfig) -> MoeSpec:
        return _qwen_moe_spec(config, shared_expert=False)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): QKV biases (unless `qkv_bias` is false),
    routed experts plus a gated shared expert."""

    @staticmethod
    def uses_qkv_bias(config: ModelConfig) -> bool:
        return bool(config.hf_config.get("qkv_bias", True))

    @staticmethod
    def moe_spec(config: ModelConfig) -> MoeSpec:
        return _qwen_moe_spec(config, shared_expert=True)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Llama's attention, every layer's MLP routed experts."""

    @staticmethod
    def moe_spec(config: ModelConfig) -> MoeSpec:
        """Every layer sparse, experts of `intermediate_size`, the top k always renormalised."""
        return MoeSpec(
            num_experts=_required(config.hf_config, "num_local_experts"),
            top_k=_required(config.hf_config, "num_experts_per_tok"),
            expert_size=config.intermediate_size,
            renormalize=True,
            sparse_layers=frozenset(range(config.num_hidden_layers)),
        )

    @staticmethod
    def _map_name(ckpt_name: str) -> tuple[str, Piece]:
        """Mixtral's names as the other families': `block_sparse_moe` as `mlp`, an expert's
        `w1` / `w3` / `w2` as its `gate_proj` / `up_proj` / `down_proj`."""
        parts = ckpt_name.replace(".block_sparse_moe.", ".mlp.").split(".")
        if len(parts) >= 2 and parts[-2] in _MIXTRAL_PROJECTIONS:
            parts[-2] = _MIXTRAL_PROJECTIONS[parts[-2]]
        return MoeForCausalLM._map_name(".".join(parts))


def check_expert_split(
    model_cls: type[nn.Module], config: ModelConfig, tp_size: int, expert_parallel: bool
) -> None:
    """ValueError naming `--tp-size` when the experts do not split over `tp_size` ranks (whole
    with `expert_parallel`, else each expert's columns, and the shared expert's), or
    `--enable-expert-parallel` for a model without experts. Checked before any rank builds
    anything, as `sharding.check_model_split` checks the rest."""
    spec = model_cls.moe_spec(config) if issubclass(model_cls, MoeForCausalLM) else None
    if spec is None or not spec.sparse_layers:
        if expert_parallel:
            raise ValueError(
                f"--enable-expert-parallel needs a mixture-of-experts model; "
                f"{config.architecture} has no experts"
            )
        return
    if expert_parallel:
        split_evenly(spec.num_experts, tp_size, EXPERTS)
    else:
        split_evenly(spec.expert_size, tp_size, EXPERT_COLUMNS)
    if spec.shared_expert_size is not None:
        split_evenly(spec.shared_expert_size, tp_size, MLP_COLUMNS)
