"""Routing: each token's top-k experts and their weights, from the router's logits, and the
count of tokens each expert receives (for /metrics).

`route` runs it all in one Triton launch where the experts run their fused kernels
(`fused_routing.py`; under torch.compile as an opaque custom op), else in torch
(`select_experts` and `count_routed_tokens`). `route_hidden` takes the router's matmul into that
launch too at a decode step's few tokens (`fused_router.py`). All leave a CUDA graph's padding
rows out of the count: a row whose KV slot is 0 (the padding slot, which only padding rows
write) counts nothing.
"""

from __future__ import annotations

import torch

from replaylm.layers.attention.ops import current_batch
from replaylm.layers.kernels import use_opaque_kernel
from replaylm.layers.linear import Linear

ROUTE_OP_NAME = "replaylm::route_experts"
ROUTE_HIDDEN_OP_NAME = "replaylm::route_hidden"
COUNT_OP_NAME = "replaylm::count_routed_tokens"


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32, expert ids `[T, k]` int32) of each token's `top_k` experts:
    softmax over all experts in float32, the top k kept, and with `renormalize` (Qwen3-MoE's
    `norm_topk_prob`, Mixtral always) scaled to sum to 1. No host sync: graph-capturable."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def count_routed_tokens(
    counts: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor | None
) -> None:
    """Add to `counts` `[E]` (int64) each routed (token, expert) pair of `ids` `[T, k]` whose
    token's KV slot in `slots` `[T]` is not 0 (None: every pair). No host sync."""
    if slots is None:
        pairs = torch.ones(ids.numel(), dtype=torch.int64, device=ids.device)
    else:
        pairs = (slots != 0).long()[:, None].expand(-1, ids.shape[1]).reshape(-1)
    counts.index_add_(0, ids.reshape(-1).long(), pairs)


class LiveTokens:
    """The KV slots `[T]` of the forward in progress (None: count every row), by which the MoE
    layers leave padding rows out of their counts. The model sets it before each forward, once
    for all its layers, which share this object."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    live: LiveTokens,
    first_expert: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts`' (weights, ids), the ids less `first_expert` (this rank's first expert
    under expert parallelism: other ranks' experts fall outside 0..E_rank-1), after adding the
    live tokens' routed pairs to `counts` `[E]` (global ids). One Triton launch where
    `use_opaque_kernel`, else torch."""
    if use_opaque_kernel(router_logits):
        from replaylm.layers.moe.fused_routing import fused_route

        if not torch.compiler.is_compiling():
            return fused_route(router_logits, top_k, renormalize, counts, live.slots, first_expert)
        # compiled code holds no batch of its own (a traced `live.slots` would stay the one it
        # saw): the ops read the attention_context's
        return torch.ops.replaylm.route_experts(
            router_logits, counts, top_k, renormalize, first_expert
        )
    weights, ids = select_experts(router_logits, top_k, renormalize)
    if torch.compiler.is_compiling():
        torch.ops.replaylm.count_routed_tokens(counts, ids)
    else:
        count_routed_tokens(counts, ids, live.slots)
    return weights, ids - first_expert if first_expert else ids


def route_hidden(
    hidden: torch.Tensor,
    router: Linear,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    live: LiveTokens,
    first_expert: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(router(hidden), ...)`; where the kernels run and the router takes the skinny
    matmul (bf16, no bias), a decode step's few tokens (`MAX_ROWS`) take the router's matmul and
    the routing in one launch (`fused_router.py`)."""
    fusable = router.matmul == "triton" and router.bias is None and router.weight_scale is None
    if fusable and use_opaque_kernel(hidden):
        if torch.compiler.is_compiling():  # the row count is symbolic: chosen in the op
            return torch.ops.replaylm.route_hidden(
                hidden, router.weight, counts, top_k, renormalize, first_expert
            )
        from replaylm.layers.moe.fused_router import route_hidden_rows

        return route_hidden_rows(
            hidden, router.weight, top_k, renormalize, counts, live.slots, first_expert
        )
    return route(router(hidden), top_k, renormalize, counts, live, first_expert)


@torch.library.custom_op(ROUTE_HIDDEN_OP_NAME, mutates_args=("counts",))
def _route_hidden_in_context(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    renormalize: bool,
    first: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from replaylm.layers.moe.fused_router import route_hidden_rows

    slots = current_batch().out_cache_loc
    return route_hidden_rows(hidden, weight, top_k, renormalize, counts, slots, first)


@_route_hidden_in_context.register_fake
def _route_hidden_in_context_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    renormalize: bool,
    first: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (hidden.shape[0], top_k)
    weights = hidden.new_empty(shape, dtype=torch.float32)
    return weights, hidden.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op(ROUTE_OP_NAME, mutates_args=("counts",))
def _route_in_context(
    router_logits: torch.Tensor, counts: torch.Tensor, top_k: int, renormalize: bool, first: int
) -> tuple[torch.Tensor, torch.Tensor]:
    from replaylm.layers.moe.fused_routing import fused_route

    slots = current_batch().out_cache_loc
    return fused_route(router_logits, top_k, renormalize, counts, slots, first)


@_route_in_context.register_fake
def _route_in_context_fake(
    router_logits: torch.Tensor, counts: torch.Tensor, top_k: int, renormalize: bool, first: int
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (router_logits.shape[0], top_k)
    weights = router_logits.new_empty(shape, dtype=torch.float32)
    return weights, router_logits.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op(COUNT_OP_NAME, mutates_args=("counts",))
def _count_in_context(counts: torch.Tensor, ids: torch.Tensor) -> None:
    count_routed_tokens(counts, ids, current_batch().out_cache_loc)


@_count_in_context.register_fake
def _count_in_context_fake(counts: torch.Tensor, ids: torch.Tensor) -> None:
    return None
