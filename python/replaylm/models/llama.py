"""Llama-family decoder (Llama 2/3/3.1, SmolLM); Qwen2 and Qwen3 reuse it with two switches.

`qkv_bias` adds biases to the fused QKV projection (Qwen2); `qk_norm` applies a per-head RMSNorm
to q and k before rope (Qwen3); `make_mlp` builds each layer's MLP (the mixture-of-experts models
of `moe` put their experts' block in their sparse layers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from replaylm.distributed.parallel_state import TPPlace, tp_place
from replaylm.distributed.sharding import (
    MLP_COLUMNS,
    HeadShard,
    Shard,
    full_shape,
    local_part,
    vocab_shard,
)
from replaylm.layers.attention.layer import Attention
from replaylm.layers.attention.ops import norm_rope_store
from replaylm.layers.feature_capture import FeatureStore, FeatureTap
from replaylm.layers.kernels import use_triton_kernels
from replaylm.layers.layernorm import RMSNorm
from replaylm.layers.linear import GateUpLinear, Linear, MergedLinear, RowParallelLinear
from replaylm.layers.logits_processor import (
    LMHead,
    LogitsProcessor,
    VocabParallelLogitsProcessor,
)
from replaylm.layers.moe.layer import ExpertPiece, FusedMoE
from replaylm.layers.quantization.config import Fp8Config
from replaylm.layers.quantization.fp8 import FP8_DTYPE, Activation, is_fp8, quantize_weight
from replaylm.layers.rotary_embedding import RotaryEmbedding
from replaylm.layers.vocab_embedding import VocabEmbedding, VocabParallelEmbedding, VocabRows
from replaylm.models.config import ModelConfig

if TYPE_CHECKING:
    from replaylm.model_executor.forward_batch import ForwardBatch

# checkpoint projection name -> (fused module name, shard)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# skipped checkpoint tensors: rope's cached frequencies, and FP8 KV-cache scales where a loader
# passes them on (the checkpoint loader takes them out first: model_loader/kv_scales.py)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".k_scale", ".v_scale", ".kv_scale")
# FP8 block-quantized checkpoints name their weight scales so (DeepSeek's, Qwen3-*-FP8)
_SCALE_ALIASES = {".weight_scale_inv": ".weight_scale"}
# what one checkpoint tensor fills of a model parameter (`_map_name`): a fused layer's shard
# ("q", "gate", ...), one expert's projection, or None: all of it
Piece = str | ExpertPiece | None


def _row_linear(shard: Shard, output_size: int, place: TPPlace, quant: Fp8Config | None) -> Linear:
    """The projection back to the hidden size from this rank's `shard` of its input columns:
    a plain Linear over all of them on one rank (no collective), else RowParallelLinear."""
    if place.size == 1:
        return Linear(shard.full, output_size, quant=quant)
    return RowParallelLinear(shard, output_size, quant)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
        place: TPPlace,
        input_size: int | None = None,
    ) -> None:
        """`input_size`: the width of the hidden states it projects (default the model's
        hidden size; an EAGLE-3 head attends over twice that)."""
        super().__init__()
        h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        heads = HeadShard.for_rank(h, hkv, place)
        sources = heads.qkv_shards(h, hkv, d)
        self.qkv_proj = MergedLinear(
            input_size or config.hidden_size,
            {name: source.size for name, source in sources.items()},
            bias=qkv_bias,
            sources=sources if place.size > 1 else None,
            quant=config.quantization,
        )
        o_shard = Shard(1, heads.head_start * d, heads.heads * d, h * d)
        self.o_proj = _row_linear(o_shard, config.hidden_size, place, config.quantization)
        self.rotary = rotary
        self.head_dim = d
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(heads.heads, heads.kv_heads, d, d**-0.5, layer_id)

    def _per_head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x.view(x.shape[0], -1, self.head_dim)).view(x.shape[0], -1)

    def _fused_norm_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor, bool | torch.Tensor]:
        """The Triton route: q/k norm (Qwen3) and rope in one kernel, reading q and k in place
        from the QKV output, and the layer's K/V store (in the same kernel where the attention
        backend allows). (q, k, `Attention`'s `kv_stored`: True, or under torch.compile the
        custom op's result)."""
        norm = (
            None
            if self.q_norm is None or self.k_norm is None
            else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        )
        cos, sin = self.rotary.cos_cache, self.rotary.sin_cache
        if torch.compiler.is_compiling():
            q_weight, k_weight, eps = norm if norm is not None else (None, None, 0.0)
            return torch.ops.replaylm.rope_store_kv(
                q, k, v, positions, cos, sin, self.head_dim, q_weight, k_weight, eps
            )
        q, k = norm_rope_store(q, k, v, positions, cos, sin, self.head_dim, norm, self.attn, batch)
        return q, k, True

    def forward(
        self, positions: torch.Tensor, hidden: Activation, batch: ForwardBatch
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if use_triton_kernels(q):
            q, k, stored = self._fused_norm_rope(positions, q, k, v, batch)
            return self.o_proj(self.attn(q, k, v, batch, kv_stored=stored))
        if self.q_norm is not None and self.k_norm is not None:
            q = self._per_head_norm(q, self.q_norm)
            k = self._per_head_norm(k, self.k_norm)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        place: TPPlace,
        quant: Fp8Config | None = None,
    ) -> None:
        """`quant`: FP8 weights (None: the model's dtype)."""
        super().__init__()
        rows = Shard.even(0, intermediate_size, place, MLP_COLUMNS)
        self.gate_up_proj = GateUpLinear(  # SiluAndMul included
            hidden_size, rows.size, rows if place.size > 1 else None, quant
        )
        columns = Shard(1, rows.start, rows.size, rows.full)
        self.down_proj = _row_linear(columns, hidden_size, place, quant)
        self.gate_up_proj.quantizes_for(self.down_proj)

    def forward(self, x: Activation) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
        place: TPPlace,
        mlp: nn.Module,
    ) -> None:
        """`mlp`: the layer's MLP, `[T, H] -> [T, H]` (partial sums under tensor parallelism)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary, qkv_bias, qk_norm, place)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # FP8 per-channel layers take their input quantized by the norm before them
        self.input_layernorm.quantizes_for(self.self_attn.qkv_proj)
        if isinstance(mlp, LlamaMLP):
            self.post_attention_layernorm.quantizes_for(mlp.gate_up_proj)
        # an EAGLE-3 head's feature: the residual stream entering this layer (summed over the
        # tensor-parallel ranks by the input norm, so whole)
        self.feature_tap: FeatureTap | None = None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.feature_tap is not None:
            self.feature_tap(residual, batch)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        qkv_bias: bool,
        qk_norm: bool,
        place: TPPlace,
        make_mlp: Callable[[int], nn.Module],
    ) -> None:
        """`make_mlp(i)`: layer i's MLP."""
        super().__init__()
        self.embed_tokens: VocabRows = (
            VocabEmbedding(config.vocab_size, config.hidden_size)
            if place.size == 1
            else VocabParallelEmbedding(vocab_shard(config.vocab_size, place), config.hidden_size)
        )
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, qkv_bias, qk_norm, place, make_mlp(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feature_tap: FeatureTap | None = None  # an EAGLE head's: the final-norm output
        self.feature_store: FeatureStore | None = None  # what the taps write, when tapped
        if place.size > 1:
            self._number_sums()

    def tap_features(self, store: FeatureStore, layers: list[int] | None) -> None:
        """Write into `store`, during every forward, the residual stream entering `layers`
        (a site each, in order), or with None the final-norm hidden states (one site)."""
        self.feature_store = store
        if layers is None:
            self.feature_tap = FeatureTap(store, 0)
            return
        for site, index in enumerate(layers):
            layer = self.layers[index]
            assert isinstance(layer, LlamaDecoderLayer)
            layer.feature_tap = FeatureTap(store, site)

    def _number_sums(self) -> None:
        """Each RowParallelLinear's partial sums are summed by the norm after them: layer i's
        attention output by its post-attention norm, its MLP output (a mixture of experts' too,
        see `layers.moe.layer`) by the next layer's input norm or the final norm. Sites in
        forward order, 2 x layers of them (even)."""
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            if i:
                layer.input_layernorm.sum_site = 2 * i - 1
            layer.post_attention_layernorm.sum_site = 2 * i
        self.norm.sum_site = 2 * len(self.layers) - 1

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        if self.feature_tap is not None:
            self.feature_tap(hidden, batch)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM: `forward(input_ids, positions, batch) -> next-token logits [B, V]` (float32).

    Built for this process's tensor-parallel place (`tp_place`): on one of several ranks, its
    share of heads, MLP columns and vocabulary, with the collectives in the row-parallel
    projections, the embedding and the logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        place = tp_place()
        self.model = LlamaModel(
            config,
            self.uses_qkv_bias(config),
            self.uses_qk_norm(),
            place,
            lambda layer_id: self.make_mlp(layer_id, place),
        )
        vocab_rows = None if place.size == 1 else vocab_shard(config.vocab_size, place)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else LMHead(config.vocab_size, config.hidden_size, vocab_rows)
        )
        self.logits_processor = (
            LogitsProcessor()
            if place.size == 1
            else VocabParallelLogitsProcessor(config.vocab_size)
        )

    @staticmethod
    def uses_qkv_bias(config: ModelConfig) -> bool:
        return config.attention_bias

    @staticmethod
    def uses_qk_norm() -> bool:
        return False

    def make_mlp(self, layer_id: int, place: TPPlace) -> nn.Module:
        """Layer `layer_id`'s MLP: the dense SwiGLU one (a mixture-of-experts model's sparse
        layers hold their experts instead)."""
        cfg = self.config
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, place, cfg.quantization)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return (self.lm_head or self.model.embed_tokens).weight

    @property
    def logits_width(self) -> int:
        """Logits per row (the vocabulary; an EAGLE-3 head's draft vocabulary)."""
        return self.config.vocab_size

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.compute_logits(self.forward_hidden(input_ids, positions, batch), batch)

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        """Final-norm hidden states `[T, H]` of every token (token-indexed only: no per-request
        shapes, so a prefill graph can capture it for a token bucket). `batch` is None under
        tc_piecewise's torch.compile, where attention reads it from `attention_context`."""
        return self.model(input_ids, positions, batch)

    def compute_logits(
        self, hidden: torch.Tensor, batch: ForwardBatch, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next-token logits `[B, V]` (float32) from `forward_hidden`'s output (into `out` when
        given: contiguous, that shape and dtype)."""
        return self.logits_processor(hidden, self.lm_head_weight, batch, out)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (whole: each sharded layer keeps its rank's part). An FP8
        layer takes FP8 tensors and their scales as they are, and quantizes a higher-precision
        weight as it arrives (`--quantization fp8`; its scale comes with it). Raises ValueError
        naming the tensor on a shape mismatch, an unexpected name, an FP8 tensor for an
        unquantized layer, or parameters (or their fused shards, or experts' projections, or
        their scales) the checkpoint did not provide."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        pending: dict[str, set[Piece]] = {}
        for name in params:
            module_name, leaf = name.rsplit(".", 1)
            pending[name] = _pieces(modules[module_name], leaf)
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(_IGNORED_SUFFIXES):
                continue
            if ckpt_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the LM head
            target, piece = self._map_name(_scale_name(ckpt_name))
            if target not in params:
                raise ValueError(f"checkpoint tensor '{ckpt_name}' has no parameter in the model")
            module_name, leaf = target.rsplit(".", 1)
            module = modules[module_name]
            for held_leaf, held in _as_held(module, leaf, params[target], tensor, ckpt_name):
                held_name = f"{module_name}.{held_leaf}"
                _load_piece(module, held_leaf, params[held_name], piece, held, ckpt_name)
                if piece is None:
                    pending[held_name].clear()
                else:
                    pending[held_name].discard(piece)
        missing = sorted(
            name if piece is None else f"{name} ({piece})"
            for name, left in pending.items()
            for piece in left
        )
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    @staticmethod
    def _map_name(ckpt_name: str) -> tuple[str, Piece]:
        """Map a checkpoint name to (model parameter name, the piece of it the tensor fills)."""
        parts = ckpt_name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return ckpt_name, None

    def checkpoint_names(self, module_name: str) -> list[str]:
        """The checkpoint's names of the module `module_name` (a fused layer's: its shards',
        `q_proj`, ...), which a quantization config's ignore list names."""
        parent, _, leaf = module_name.rpartition(".")
        unfused = [
            f"{parent}.{proj}" for proj, (fused, _) in _FUSED_SHARDS.items() if fused == leaf
        ]
        return unfused or [module_name]


def _scale_name(ckpt_name: str) -> str:
    """`ckpt_name` with a weight scale's alias (`weight_scale_inv`) as the model names it."""
    for alias, name in _SCALE_ALIASES.items():
        if ckpt_name.endswith(alias):
            return ckpt_name[: -len(alias)] + name
    return ckpt_name


def _pieces(module: nn.Module, leaf: str) -> set[Piece]:
    """The pieces (`Piece`) that checkpoint tensors fill of `module`'s parameter `leaf`."""
    if isinstance(module, MergedLinear):
        return set(module.shard_sizes)
    if isinstance(module, FusedMoE):
        return set(module.pieces(leaf))
    return {None}


def _as_held(
    module: nn.Module, leaf: str, param: nn.Parameter, tensor: torch.Tensor, ckpt_name: str
) -> list[tuple[str, torch.Tensor]]:
    """The (parameter leaf, tensor) pairs the checkpoint tensor `tensor` of `module`'s
    parameter `leaf` fills: itself, or for a higher-precision weight of an FP8 layer its FP8
    values and their scales, quantized as the layer holds them on the parameter's device
    (`--quantization fp8`). ValueError naming an FP8 tensor the layer does not hold in FP8."""
    fp8_tensor = tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1
    if fp8_tensor and not is_fp8(param):
        raise ValueError(
            f"checkpoint tensor '{ckpt_name}' is {tensor.dtype}, but the model holds it "
            "unquantized (a router, or a layer the quantization config leaves unquantized)"
        )
    if not is_fp8(param) or is_fp8(tensor):
        return [(leaf, tensor)]
    if fp8_tensor or not tensor.dtype.is_floating_point:
        raise ValueError(
            f"checkpoint tensor '{ckpt_name}' is {tensor.dtype}; the model holds it {FP8_DTYPE}"
        )
    assert isinstance(module, (Linear, FusedMoE)) and module.quant is not None
    q, scale = quantize_weight(tensor.to(param.device), module.quant.block_size)
    return [(leaf, q), (f"{leaf}_scale", scale)]


def _load_piece(
    module: nn.Module,
    leaf: str,
    param: nn.Parameter,
    piece: Piece,
    tensor: torch.Tensor,
    ckpt_name: str,
) -> None:
    """Copy this rank's part of the checkpoint tensor `tensor` (named `ckpt_name`) into `piece`
    of `module`'s parameter `leaf` (`param`). ValueError naming it on a shape mismatch."""
    if isinstance(piece, ExpertPiece):
        assert isinstance(module, FusedMoE)
        module.load_expert(piece.expert, piece.proj, tensor, ckpt_name, leaf)
    elif piece is not None:
        assert isinstance(module, MergedLinear)
        module.load_shard(leaf, piece, tensor, ckpt_name)
    else:
        if isinstance(module, Linear):
            tensor = module.as_held(leaf, tensor)
        expected = full_shape(module, leaf)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for '{ckpt_name}': checkpoint has "
                f"{tuple(tensor.shape)}, model expects {expected}"
            )
        param.copy_(local_part(module, leaf, tensor))
