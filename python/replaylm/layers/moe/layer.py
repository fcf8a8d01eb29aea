"""The mixture-of-experts MLP a model holds: `FusedMoE`, every expert's SwiGLU weights stacked
and run on the tokens the router sends them, and the sparse blocks around it: `SparseMoeBlock`
(Qwen3-MoE, Mixtral: a router and the experts) and `SharedExpertMoeBlock` (Qwen2-MoE: plus a
shared expert that every token takes, scaled by a sigmoid gate).

Under tensor parallelism every rank holds every expert, with an even slice of each expert's
intermediate columns, as the dense MLP splits its own: the slice's gate and up rows and the
down projection's matching columns. Each rank's output is then its partial sums of the block's
output, which the next RMSNorm sums over the ranks (its `sum_site`) exactly as it sums the dense
MLP's: the router, whole on every rank and fed the whole hidden states, picks the same experts
with the same weights everywhere, and weighting is linear, so the partial sums add up.

Under expert parallelism (`--enable-expert-parallel`, `TPPlace.expert_parallel`) rank r of N
holds experts r*E/N .. (r+1)*E/N - 1 instead, whole. Dispatch and combine need no collective of
their own: every rank already holds the whole hidden states (the norm before the block summed
them) and routes every token alike, so each rank runs its own experts on the tokens routed to
them (the ids of other ranks' experts, shifted out of 0..E/N-1, add nothing in either kernel)
and its output is a partial sum that the next RMSNorm's all-reduce combines, as above. An
all-to-all would only pay where ranks hold different tokens (data-parallel attention); vLLM
(`expert_map`, all-to-all kernels only with data parallelism) and SGLang's EP MoE do the same.

Each FusedMoE also counts, on the device, the tokens routed to each of its experts
(`routed_tokens`, all experts on every rank), for /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from replaylm.distributed.parallel_state import TPPlace
from replaylm.distributed.sharding import Shard
from replaylm.layers.linear import Linear
from replaylm.layers.moe.experts import fused_experts
from replaylm.layers.moe.routed_rows import RoutedRows
from replaylm.layers.moe.routing import LiveTokens, route, route_hidden
from replaylm.layers.moe.torch_experts import Fp8ExpertScales
from replaylm.layers.quantization.config import Fp8Config
from replaylm.layers.quantization.fp8 import FP8_DTYPE
from replaylm.layers.quantization.layout import as_held, scale_shape, scale_shard

EXPERT_COLUMNS = "expert intermediate (MoE) columns"
# what expert parallelism splits over the ranks, whole (in the error when they do not divide)
EXPERTS = "experts (placed whole under --enable-expert-parallel)"
GATE_UP = ("gate", "up")


@dataclass(frozen=True)
class ExpertPiece:
    """One checkpoint tensor of a FusedMoE: expert `expert`'s `proj` projection ("gate", "up"
    or "down")."""

    expert: int
    proj: str

    def __str__(self) -> str:
        return f"expert {self.expert} {self.proj}_proj"


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU experts of `intermediate_size` columns each. This rank holds
    `local_experts` of them (all, or an even share under expert parallelism) and `columns` of
    each one's intermediate columns (an even share under tensor parallelism, all of them under
    expert parallelism): `w13_weight` `[E_rank, 2 * I_rank, H]` (each expert's gate rows, then
    its up rows) and `w2_weight` `[E_rank, H, I_rank]`. `forward(hidden, router_logits)` sends
    each token to its `top_k` experts (their softmax weights, renormalised to sum to 1 with
    `renormalize`) and sums what this rank's experts return, weighted.

    With `quant` the weights are FP8 (e4m3) with float32 `w13_weight_scale` / `w2_weight_scale`
    (per channel `[E_rank, 2 I_rank]` / `[E_rank, H]`, or per block: `[E_rank, 2 I_rank / bn,
    ceil(H / bk)]` / `[E_rank, ceil(H / bn), ceil(I_rank / bk)]`, each expert's gate and up
    blocks apart, so `I_rank` must be whole blocks) and, for static activations,
    `w13_input_scale` `[E_rank, 2]` / `w2_input_scale` `[E_rank, 1]`: each checkpoint tensor's.

    `routed_tokens` `[E]` (int64, on the device) counts the tokens routed to each expert so far,
    every expert's on every rank (the routing is the same on all), a CUDA graph's padding rows
    left out by `live` (the model's, shared by its layers)."""

    routed_tokens: torch.Tensor
    w13_weight_scale: nn.Parameter | None
    w2_weight_scale: nn.Parameter | None
    w13_input_scale: nn.Parameter | None
    w2_input_scale: nn.Parameter | None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        renormalize: bool,
        place: TPPlace,
        quant: Fp8Config | None = None,
    ) -> None:
        super().__init__()
        experts_place, columns_place = (
            (place, TPPlace()) if place.expert_parallel else (TPPlace(), place)
        )
        self.local_experts = Shard.even(0, num_experts, experts_place, EXPERTS)
        self.columns = Shard.even(0, intermediate_size, columns_place, EXPERT_COLUMNS)
        self.make_weights(quant, hidden_size)
        self.register_buffer(
            "routed_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        self.live = LiveTokens()
        self.top_k = top_k
        self.renormalize = renormalize

    def make_weights(self, quant: Fp8Config | None, hidden_size: int) -> None:
        """(Re)allocate the experts' weights: in the default dtype, or (`quant`) in FP8 with
        their scales. The loader calls it with None for experts the checkpoint leaves
        unquantized."""
        self.quant = quant
        experts, size = self.local_experts.size, self.columns.size
        shapes = {"w13": (experts, 2 * size, hidden_size), "w2": (experts, hidden_size, size)}
        self.w13_weight_scale = self.w2_weight_scale = None
        self.w13_input_scale = self.w2_input_scale = None
        if quant is None:
            self.w13_weight = nn.Parameter(torch.empty(shapes["w13"]))
            self.w2_weight = nn.Parameter(torch.empty(shapes["w2"]))
            return
        block = quant.block_size
        if block is not None and size % block[0]:
            columns = (
                f"--tp-size splits each expert's {self.columns.full} intermediate columns into "
                f"parts of {size}, not"
                if size < self.columns.full
                else f"each expert's {size} intermediate columns are not"
            )
            raise ValueError(
                f"FP8 block scales: {columns} whole blocks of {block[0]} (the checkpoint's "
                f"block size {list(block)})"
            )
        for w, (e, n, k) in shapes.items():
            fp8 = torch.empty((e, n, k), dtype=FP8_DTYPE)
            scale = torch.empty((e, *scale_shape(n, k, block)), dtype=torch.float32)
            setattr(self, f"{w}_weight", nn.Parameter(fp8, requires_grad=False))
            setattr(self, f"{w}_weight_scale", nn.Parameter(scale, requires_grad=False))
            if quant.static_activations:
                inputs = torch.empty((e, 2 if w == "w13" else 1), dtype=torch.float32)
                setattr(self, f"{w}_input_scale", nn.Parameter(inputs, requires_grad=False))
        for proj in ("gate", "down"):  # a rank's columns of block scales: whole blocks, or an error
            self._part_shard(proj, "weight_scale")

    @property
    def num_experts(self) -> int:
        """The model's experts, this rank's or not."""
        return self.local_experts.full

    @property
    def hidden_size(self) -> int:
        return self.w13_weight.shape[2]

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """`hidden` `[T, H]` through each token's experts, chosen by `router_logits` `[T, E]`;
        only this rank's experts' share under expert parallelism (a partial sum)."""
        weights, ids = route(
            router_logits,
            self.top_k,
            self.renormalize,
            self.routed_tokens,
            self.live,
            self.local_experts.start,
        )
        out = self._experts(hidden, weights, ids)
        assert isinstance(out, torch.Tensor)  # summed: no defer_sum
        return out

    def forward_with_router(
        self, hidden: torch.Tensor, router: Linear, defer_sum: bool = False
    ) -> torch.Tensor | RoutedRows:
        """`forward(hidden, router(hidden))`, the router's matmul taken into the routing's launch
        where `route_hidden` can; `defer_sum`: `fused_experts`'."""
        weights, ids = route_hidden(
            hidden,
            router,
            self.top_k,
            self.renormalize,
            self.routed_tokens,
            self.live,
            self.local_experts.start,
        )
        return self._experts(hidden, weights, ids, defer_sum)

    def _experts(
        self,
        hidden: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        defer_sum: bool = False,
    ) -> torch.Tensor | RoutedRows:
        return fused_experts(
            hidden, self.w13_weight, self.w2_weight, weights, ids, self._fp8(), defer_sum
        )

    def _fp8(self) -> Fp8ExpertScales | None:
        if self.quant is None:
            return None
        assert self.w13_weight_scale is not None and self.w2_weight_scale is not None
        return Fp8ExpertScales(
            self.w13_weight_scale,
            self.w2_weight_scale,
            self.quant.block_size,
            self.w13_input_scale,
            self.w2_input_scale,
        )

    def _held(self) -> range:
        """The ids of this rank's experts."""
        return range(self.local_experts.start, self.local_experts.start + self.local_experts.size)

    def pieces(self, name: str) -> list[ExpertPiece]:
        """The per-expert checkpoint tensors that fill parameter `name`: this rank's experts'."""
        return [ExpertPiece(e, proj) for e in self._held() for proj in _projections(name)]

    def load_expert(
        self, expert: int, proj: str, tensor: torch.Tensor, ckpt: str, name: str | None = None
    ) -> None:
        """Copy this rank's part of expert `expert`'s `proj` checkpoint tensor `tensor` (named
        `ckpt`) of parameter `name` (default its weight, `w13_weight` or `w2_weight`; FP8 scales:
        `w13_weight_scale`, ...: gate and up weights `[I, H]`, down `[H, I]`, their scales and
        input scales) into place; an expert another rank holds is skipped. ValueError naming it
        for an expert the model does not have or a wrong shape."""
        name = name or ("w2_weight" if proj == "down" else "w13_weight")
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"checkpoint tensor '{ckpt}' has no parameter in the model "
                f"(it has {self.num_experts} experts)"
            )
        kind = name.split("_", 1)[1]
        rows = self.hidden_size if proj == "down" else self.columns.full
        block = None if self.quant is None else self.quant.block_size
        tensor = as_held(kind, tensor, rows, block)
        expected = self._part_shape(proj, kind)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for '{ckpt}': checkpoint has {tuple(tensor.shape)}, "
                f"model expects {expected}"
            )
        if expert not in self._held():
            return
        shard = self._part_shard(proj, kind)
        with torch.no_grad():
            self._expert_part(expert, proj, name).copy_(
                tensor if shard is None else shard.take(tensor)
            )

    def _part_shape(self, proj: str, kind: str) -> tuple[int, ...]:
        """The checkpoint's shape of one expert's `proj` tensor of `kind` ("weight",
        "weight_scale" or "input_scale")."""
        full, hidden = self.columns.full, self.hidden_size
        rows, cols = (hidden, full) if proj == "down" else (full, hidden)
        if kind == "weight":
            return (rows, cols)
        if kind == "input_scale":
            return (1,)
        assert self.quant is not None
        return scale_shape(rows, cols, self.quant.block_size)

    def _part_shard(self, proj: str, kind: str) -> Shard | None:
        """Where this rank's part lies in one expert's `proj` tensor of `kind` (None: all of
        it): its intermediate columns, rows of gate and up, columns of down."""
        dim = 1 if proj == "down" else 0
        columns = Shard(dim, self.columns.start, self.columns.size, self.columns.full)
        if kind == "weight":
            return columns
        if kind == "input_scale":
            return None
        assert self.quant is not None
        return scale_shard(columns, self.quant.block_size)

    def _expert_part(self, expert: int, proj: str, name: str) -> torch.Tensor:
        """Where this rank's expert `expert`'s `proj` part of parameter `name` lies (a view):
        w2's whole, or w13's gate or up half."""
        held = getattr(self, name)[expert - self.local_experts.start]
        if proj == "down":
            return held
        half = held.shape[0] // 2
        return held.narrow(0, GATE_UP.index(proj) * half, half)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint's shape of parameter `name` stacked over the experts (transformers'
        `gate_up_proj` / `down_proj`, gate and up stacked along rows)."""
        kind = name.split("_", 1)[1]
        shapes = [self._part_shape(proj, kind) for proj in _projections(name)]
        return (self.num_experts, sum(s[0] for s in shapes), *shapes[0][1:])

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a stacked checkpoint tensor (`full_shape`'s): of this rank's
        experts, each projection's part (`_part_shard`), gate's then up's for w13."""
        mine = full.narrow(0, self.local_experts.start, self.local_experts.size)
        kind, projs = name.split("_", 1)[1], _projections(name)
        parts = []
        for proj, whole in zip(projs, mine.chunk(len(projs), dim=1), strict=True):
            shard = self._part_shard(proj, kind)
            parts.append(whole if shard is None else replace(shard, dim=shard.dim + 1).take(whole))
        return torch.cat(parts, dim=1)


def _projections(name: str) -> tuple[str, ...]:
    """The projections whose checkpoint tensors fill parameter `name` (`w13_*`, `w2_*`)."""
    return ("down",) if name.startswith("w2_") else GATE_UP


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's and Mixtral's MLP: the router `gate` (whole on every rank: it reads the
    whole hidden states) and the `experts` it routes each token to. On the fused kernels'
    sorted route the output comes before its weighted sum (`RoutedRows`), which the residual-add
    RMSNorm after the layer takes into its own launch."""

    def __init__(self, hidden_size: int, experts: FusedMoE) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, experts.num_experts)
        self.experts = experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | RoutedRows:
        return self.experts.forward_with_router(hidden, self.gate, defer_sum=True)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE's MLP: the routed experts plus `shared_expert(x)`, a dense MLP every token
    takes (split over the ranks like the model's dense MLP, so partial sums as well), scaled by
    `sigmoid(shared_expert_gate(x))` (whole on every rank)."""

    def __init__(self, hidden_size: int, experts: FusedMoE, shared_expert: nn.Module) -> None:
        super().__init__(hidden_size, experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        routed = self.experts.forward_with_router(hidden, self.gate)
        assert isinstance(routed, torch.Tensor)  # summed: no defer_sum
        return routed + shared
