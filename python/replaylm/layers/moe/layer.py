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

from dataclasses import dataclass

import torch
from torch import nn

from replaylm.distributed.parallel_state import TPPlace
from replaylm.distributed.sharding import Shard
from replaylm.layers.attention.ops import current_batch
from replaylm.layers.linear import Linear
from replaylm.layers.moe.experts import fused_experts
from replaylm.layers.moe.routing import select_experts

EXPERT_COLUMNS = "expert intermediate (MoE) columns"
# what expert parallelism splits over the ranks, whole (in the error when they do not divide)
EXPERTS = "experts (placed whole under --enable-expert-parallel)"
GATE_UP = ("gate", "up")
COUNT_OP_NAME = "replaylm::count_routed_tokens"


@dataclass(frozen=True)
class ExpertPiece:
    """One checkpoint tensor of a FusedMoE: expert `expert`'s `proj` projection ("gate", "up"
    or "down")."""

    expert: int
    proj: str

    def __str__(self) -> str:
        return f"expert {self.expert} {self.proj}_proj"


def live_pairs(slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """int64 `[T * top_k]`: for each routed (token, slot) pair of tokens at KV slots `slots`
    `[T]`, 1, or 0 where the slot is 0: the padding slot, which only a CUDA graph's padding rows
    write."""
    return (slots != 0).long()[:, None].expand(-1, top_k).reshape(-1)


def count_routed_tokens(
    counts: torch.Tensor, ids: torch.Tensor, pairs: torch.Tensor | None
) -> None:
    """Add to `counts` `[E]` (int64) each routed (token, expert) pair of `ids` `[T, k]`, by its
    weight in `pairs` (`live_pairs`; None: 1 each). One kernel, no host sync: CUDA graphs
    capture it."""
    if pairs is None:
        pairs = torch.ones(ids.numel(), dtype=torch.int64, device=ids.device)
    counts.index_add_(0, ids.reshape(-1), pairs)


@torch.library.custom_op(COUNT_OP_NAME, mutates_args=("counts",))
def _count_in_context(counts: torch.Tensor, ids: torch.Tensor) -> None:
    """`count_routed_tokens` of the live tokens of the open attention_context's batch: compiled
    code (tc_piecewise) has no batch of its own."""
    slots = current_batch().out_cache_loc
    count_routed_tokens(counts, ids, live_pairs(slots, ids.shape[1]))


@_count_in_context.register_fake
def _count_in_context_fake(counts: torch.Tensor, ids: torch.Tensor) -> None:
    return None


class LiveTokens:
    """Which rows of the forward in progress the MoE layers count: `pairs` (`live_pairs`), or
    None: every row. The model sets it before each forward, once for all its layers, which
    share this object."""

    def __init__(self) -> None:
        self.pairs: torch.Tensor | None = None


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU experts of `intermediate_size` columns each. This rank holds
    `local_experts` of them (all, or an even share under expert parallelism) and `columns` of
    each one's intermediate columns (an even share under tensor parallelism, all of them under
    expert parallelism): `w13_weight` `[E_rank, 2 * I_rank, H]` (each expert's gate rows, then
    its up rows) and `w2_weight` `[E_rank, H, I_rank]`. `forward(hidden, router_logits)` sends
    each token to its `top_k` experts (their softmax weights, renormalised to sum to 1 with
    `renormalize`) and sums what this rank's experts return, weighted.

    `routed_tokens` `[E]` (int64, on the device) counts the tokens routed to each expert so far,
    every expert's on every rank (the routing is the same on all), a CUDA graph's padding rows
    left out by `live` (the model's, shared by its layers)."""

    routed_tokens: torch.Tensor

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
        experts_place, columns_place = (
            (place, TPPlace()) if place.expert_parallel else (TPPlace(), place)
        )
        self.local_experts = Shard.even(0, num_experts, experts_place, EXPERTS)
        self.columns = Shard.even(0, intermediate_size, columns_place, EXPERT_COLUMNS)
        experts, size = self.local_experts.size, self.columns.size
        self.w13_weight = nn.Parameter(torch.empty(experts, 2 * size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(experts, hidden_size, size))
        self.register_buffer(
            "routed_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        self.live = LiveTokens()
        self.top_k = top_k
        self.renormalize = renormalize

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
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        self.count(ids)
        first = self.local_experts.start
        if first:  # local ids; the experts of ranks before this one fall below 0
            ids = ids - first
        return fused_experts(hidden, self.w13_weight, self.w2_weight, weights, ids)

    def count(self, ids: torch.Tensor) -> None:
        """Add the routed expert ids `ids` `[T, k]` to `routed_tokens` (`count_routed_tokens`),
        padding rows left out: by `live`, or under torch.compile (whose trace would keep the
        tensor `live` held when traced) by the attention_context's batch, in a custom op."""
        if torch.compiler.is_compiling():
            torch.ops.replaylm.count_routed_tokens(self.routed_tokens, ids)
        else:
            count_routed_tokens(self.routed_tokens, ids, self.live.pairs)

    def _held(self) -> range:
        """The ids of this rank's experts."""
        return range(self.local_experts.start, self.local_experts.start + self.local_experts.size)

    def pieces(self, name: str) -> list[ExpertPiece]:
        """The per-expert checkpoint tensors that fill parameter `name`: this rank's experts'."""
        projs = ("down",) if name == "w2_weight" else GATE_UP
        return [ExpertPiece(e, proj) for e in self._held() for proj in projs]

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's columns of expert `expert`'s whole `proj` projection `tensor`
        (named `name` in the checkpoint; gate and up `[I, H]`, down `[H, I]`) into place; an
        expert another rank holds is skipped. ValueError naming it for an expert the model
        does not have or a wrong shape."""
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
        if expert not in self._held():
            return
        with torch.no_grad():
            self._expert_part(expert, proj).copy_(self._rank_columns(tensor, dim))

    def _expert_part(self, expert: int, proj: str) -> torch.Tensor:
        """Where this rank's expert `expert`'s `proj` projection lies in the parameters (a
        view)."""
        index = expert - self.local_experts.start
        if proj == "down":
            return self.w2_weight[index]
        size = self.columns.size
        return self.w13_weight[index].narrow(0, GATE_UP.index(proj) * size, size)

    def _rank_columns(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of the intermediate columns, which lie along `dim` of `full`."""
        return full.narrow(dim, self.columns.start, self.columns.size)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint's shape of parameter `name` stacked over the experts (transformers'
        `gate_up_proj` / `down_proj`)."""
        e, h, i = self.num_experts, self.hidden_size, self.columns.full
        return (e, h, i) if name == "w2_weight" else (e, 2 * i, h)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a stacked checkpoint tensor (`full_shape`'s): of this rank's
        experts, its columns of each one's down projection, or of each one's gate rows and of
        its up rows."""
        mine = full.narrow(0, self.local_experts.start, self.local_experts.size)
        if name == "w2_weight":
            return self._rank_columns(mine, 2)
        return torch.cat([self._rank_columns(half, 1) for half in mine.chunk(2, dim=1)], dim=1)


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
