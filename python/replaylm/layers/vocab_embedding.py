"""Token embedding (and, when tied, the LM head weight); under tensor parallelism each rank holds
a slice of the vocabulary's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaylm.distributed.communication import all_reduce
from replaylm.distributed.sharding import Shard


class VocabRows(nn.Module):
    """A `[V, H]` weight over the vocabulary, or this rank's rows of it (`shard`, padded with
    zero rows past the vocabulary), allocated uninitialised."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard | None = None) -> None:
        super().__init__()
        self.shard = shard
        rows = vocab_size if shard is None else shard.size
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint tensor `full` of parameter `name`."""
        return full if self.shard is None else self.shard.take(full)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint's shape of parameter `name`."""
        local = getattr(self, name).shape
        return tuple(local) if self.shard is None else self.shard.full_shape(local)


class VocabEmbedding(VocabRows):
    """`[T] int64 -> [T, H]` lookup into a `[V, H]` table."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class VocabParallelEmbedding(VocabRows):
    """The lookup with the vocabulary's rows split over the ranks: each rank looks up the ids it
    holds, zeros the others, and the ranks' rows are summed (all-reduce)."""

    def __init__(self, shard: Shard, hidden_size: int) -> None:
        super().__init__(shard.full, hidden_size, shard)
        self.vocab_start = shard.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local * held, self.weight)
        return all_reduce(rows.masked_fill_(~held.unsqueeze(-1), 0.0))
