"""Routing: each token's top-k experts and their weights, from the router's logits."""

from __future__ import annotations

import torch


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
