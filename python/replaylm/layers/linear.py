"""Linear layers without initialisation (weights are loaded or filled by the loader)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x W^T (+ b)` with `W` `[out, in]`, allocated uninitialised on the default device."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input fused into one matmul (QKV, gate-up).

    `shards` maps a shard name to its output width, in output order; `load_shard` copies one
    checkpoint tensor into its rows.
    """

    def __init__(self, input_size: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shards.values()), bias)
        self.shard_sizes = dict(shards)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor, name: str) -> None:
        """Copy `tensor` (named `name` in the checkpoint) into `shard`'s rows of `param`."""
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for '{name}': checkpoint has {tuple(tensor.shape)}, "
                f"model expects {expected}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output back into its shards, in order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)
