"""A mixture of experts' output before its weighted sum, for the RMSNorm after it to sum."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RoutedRows(NamedTuple):
    """Each token's expert rows before their weighted sum: `rows` `[T * top_k, H]` (token t's
    slot s at row t * top_k + s), `weights` `[T, top_k]` float32, expert `ids` `[T, top_k]`
    int32 (an id outside 0..num_experts-1 adds nothing; its row was never written). The fused
    kernels' sorted route hands these to the residual-add RMSNorm after the layer, which sums
    them in its own launch (the weighted sum's launch saved: docs/tuning.md, "MoE weighted sum
    in the norm"); every other reader sums them first (`weighted_sum.weighted_sum`)."""

    rows: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    num_experts: int
