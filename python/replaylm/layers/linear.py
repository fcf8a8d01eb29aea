"""Linear layers without initialisation (weights are loaded or filled by the loader), and the
choice of kernel for small-batch matmuls (`--small-batch-matmul`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaylm.layers.kernels import use_triton_kernels

SMALL_BATCH_MATMULS = ("cublas", "triton")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           small_batch_matmul: str) -> torch.Tensor:
    """`F.linear`, except with `small_batch_matmul="triton"` on the Triton route
    (`use_triton_kernels`), where inputs of at most 16 rows take the skinny split-K kernel."""
    if small_batch_matmul == "triton" and use_triton_kernels(x):
        from replaylm.layers.kernels import ops

        return ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def set_small_batch_matmul(model: nn.Module, kernel: str) -> None:
    """Make every matmul layer of `model` (those with a `small_batch_matmul` attribute) use
    `kernel` (one of SMALL_BATCH_MATMULS) for inputs of few rows."""
    if kernel not in SMALL_BATCH_MATMULS:
        raise ValueError(f"small-batch matmul must be one of {', '.join(SMALL_BATCH_MATMULS)}, "
                         f"not '{kernel}'")
    for module in model.modules():
        if hasattr(module, "small_batch_matmul"):
            module.small_batch_matmul = kernel


class Linear(nn.Module):
    """`y = x W^T (+ b)` with `W` `[out, in]`, allocated uninitialised on the default device."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.small_batch_matmul = "cublas"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_batch_matmul)


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
