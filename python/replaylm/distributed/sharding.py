"""Each rank's part of the model: whole attention heads (KV heads replicated when there are
fewer than ranks), an even slice of the MLP, a padded slice of the vocabulary, and `Shard`, the
rank's part of one checkpoint tensor. A size that does not divide is a ValueError naming
`--tp-size` and the model's number."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from replaylm.distributed.parallel_state import TPPlace

MLP_COLUMNS = "intermediate (MLP) columns"


@dataclass(frozen=True)
class Shard:
    """The rank's `size` entries from `start` along `dim` of a checkpoint tensor whose `dim` has
    `full` entries; past `full` (the padded vocabulary's last rank) the rank holds zeros."""

    dim: int
    start: int
    size: int
    full: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's part of `full` (a tensor of the whole size along `dim`)."""
        end = min(self.start + self.size, self.full)
        part = full.narrow(self.dim, self.start, end - self.start)
        if end - self.start == self.size:
            return part
        pad = list(part.shape)
        pad[self.dim] = self.size - (end - self.start)
        return torch.cat([part, part.new_zeros(pad)], dim=self.dim)

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        """The checkpoint tensor's shape, given the rank's part's."""
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    @classmethod
    def even(cls, dim: int, full: int, place: TPPlace, what: str) -> Shard:
        """Rank `place.rank`'s equal part of `full` entries along `dim` (`what`: the model's
        name for them, in the error when `place.size` does not divide `full`)."""
        size = split_evenly(full, place.size, what)
        return cls(dim, place.rank * size, size, full)


def split_evenly(total: int, size: int, what: str) -> int:
    """`total / size`; ValueError naming both numbers when `size` does not divide `total`."""
    if total % size:
        raise ValueError(f"--tp-size {size} does not divide the model's {total} {what}")
    return total // size


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: `heads` query heads from `head_start`, and `kv_heads`
    KV heads from `kv_head_start` (one replicated KV head when there are fewer KV heads than
    ranks: the one its query heads read)."""

    heads: int
    head_start: int
    kv_heads: int
    kv_head_start: int

    @classmethod
    def for_rank(cls, num_heads: int, num_kv_heads: int, place: TPPlace) -> HeadShard:
        heads = split_evenly(num_heads, place.size, "attention heads")
        if num_kv_heads >= place.size:
            kv_heads = split_evenly(num_kv_heads, place.size, "KV heads")
        elif place.size % num_kv_heads:
            raise ValueError(
                f"--tp-size {place.size} is not a multiple of the model's {num_kv_heads} KV "
                "heads (with fewer KV heads than ranks, each is replicated on as many ranks)"
            )
        else:
            kv_heads = 1
        return cls(heads, place.rank * heads, kv_heads, place.rank * num_kv_heads // place.size)

    def qkv_shards(self, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, Shard]:
        """Where the rank's rows of the q, k and v projections lie in the checkpoint's."""
        d = head_dim
        q = Shard(0, self.head_start * d, self.heads * d, num_heads * d)
        kv = Shard(0, self.kv_head_start * d, self.kv_heads * d, num_kv_heads * d)
        return {"q": q, "k": kv, "v": kv}


def check_model_split(
    num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int
) -> None:
    """ValueError naming `--tp-size` and the model's number when its heads or MLP columns
    cannot be split over `tp_size` ranks (checked before any rank builds anything)."""
    place = TPPlace(0, tp_size)
    HeadShard.for_rank(num_heads, num_kv_heads, place)
    Shard.even(0, intermediate_size, place, MLP_COLUMNS)


def vocab_shard(vocab_size: int, place: TPPlace) -> Shard:
    """The rank's rows of the embedding and the LM head: the vocabulary split in equal parts,
    the last one padded with zero rows (whose logits are cut after the gather)."""
    size = -(-vocab_size // place.size)
    return Shard(0, place.rank * size, size, vocab_size)


@runtime_checkable
class HoldsShards(Protocol):
    """A layer whose parameters may be this rank's parts of the checkpoint's tensors."""

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor: ...

    def full_shape(self, name: str) -> tuple[int, ...]: ...


def local_part(module: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the checkpoint tensor `full` of `module`'s parameter `name`."""
    return module.local_part(name, full) if isinstance(module, HoldsShards) else full


def full_shape(module: nn.Module, name: str) -> tuple[int, ...]:
    """The checkpoint's shape of `module`'s parameter `name`."""
    if isinstance(module, HoldsShards):
        return module.full_shape(name)
    return tuple(getattr(module, name).shape)
