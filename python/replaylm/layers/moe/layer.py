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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from replaylm.distributed.parallel_state import TPPlace
from replaylm.distributed.sharding import Shard
from replaylm.layers.linear import Linear
from replaylm.layers.moe.experts import fused_experts
from replaylm.layers.moe.routing import select_experts

EXPERT_COLUMNS = "expert intermediate (MoE) columns"
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
    """`num_experts` SwiGLU experts of `intermediate_size` columns each (this rank's share of
    them under tensor parallelism): `w13_weight` `[E, 2 * I_rank, H]` (each expert's gate rows,
    then its up rows) and `w2_weight` `[E, H, I_rank]`. `forward(hidden, router_logits)` sends
    each token to its `top_k` experts (their softmax weights, renormalised to sum to 1 with
    `renormalize`) and sums what they return, weighted."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        renormalize: bool,
        place: TPPlace,
    ) -> None:
        super().__init__()
        self.columns = Shard.even(0, intermediate_size, place, EXPERT_COLUMNS)
        size = self.columns.size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        self.top_k = top_k
        self.renormalize = renormalize

    @property
    def num_experts(self) -> int:
        return self.w13_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_weight.shape[2]

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """`hidden` `[T, H]` through each token's experts, chosen by `router_logits` `[T, E]`."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return fused_experts(hidden, self.w13_weight, self.w2_weight, weights, ids)

    def pieces(self, name: str) -> list[ExpertPiece]:
        """The per-expert checkpoint tensors that fill parameter `name`."""
        projs = ("down",) if name == "w2_weight" else GATE_UP
        return [ExpertPiece(e, proj) for e in range(self.num_experts) for proj in projs]

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's columns of expert `expert`'s whole `proj` projection `tensor`
        (named `name` in the checkpoint; gate and up `[I, H]`, down `[H, I]`) into place.
        ValueError naming it for an expert the model does not have or a wrong shape."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"checkpoint tensor '{name}' has no parameter in the model "
                f"(it has {self.num_experts} experts)"
            )
        full, hidden = self.columns.full, self.hidden_size
        dim, expected = (1, (hidden, full)) if proj == "down" else (0, (full, hidden))
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for '{name}': checkpoint has {tuple(tensor.shape)}, "
                f"model expects {expected}"
            )
        with torch.no_grad():
            self._expert_part(expert, proj).copy_(self._rank_columns(tensor, dim))

    def _expert_part(self, expert: int, proj: str) -> torch.Tensor:
        """Where expert `expert`'s `proj` projection lies in the parameters (a view)."""
        if proj == "down":
            return self.w2_weight[expert]
        size = self.columns.size
        return self.w13_weight[expert].narrow(0, GATE_UP.index(proj) * size, size)

    def _rank_columns(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of the intermediate columns, which lie along `dim` of `full`."""
        return full.narrow(dim, self.columns.start, self.columns.size)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint's shape of parameter `name` stacked over the experts (transformers'
        `gate_up_proj` / `down_proj`)."""
        e, h, i = self.num_experts, self.hidden_size, self.columns.full
        return (e, h, i) if name == "w2_weight" else (e, 2 * i, h)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a stacked checkpoint tensor (`full_shape`'s): its columns of each
        expert's down projection, or of each expert's gate rows and of its up rows."""
        if name == "w2_weight":
            return self._rank_columns(full, 2)
        return torch.cat([self._rank_columns(half, 1) for half in full.chunk(2, dim=1)], dim=1)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's and Mixtral's MLP: the router `gate` (whole on every rank: it reads the
    whole hidden states) and the `experts` it routes each token to."""

    def __init__(self, hidden_size: int, experts: FusedMoE) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, experts.num_experts)
        self.experts = experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


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
        return super().forward(hidden) + shared
