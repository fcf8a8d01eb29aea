"""How an FP8 layer holds its scales, and each tensor-parallel rank's part of them.

A weight `[N, K]` holds float32 scales `[N]` (per channel; a checkpoint's per-tensor scale
repeated over the rows it covers) or `[ceil(N/bn), ceil(K/bk)]` (per block). A rank's rows of
the weight (a column-parallel layer) take the same rows of per-channel scales; its columns (a
row-parallel layer) take all of them, each being the whole row's. Block scales split in whole
blocks, so a rank's part must start on a block boundary and end on one or at the weight's edge
(its last, ragged block): a ValueError naming `--tp-size` and the block size otherwise.
"""

from __future__ import annotations

import torch

from replaylm.distributed.sharding import Shard
from replaylm.layers.quantization.fp8 import Block


def scale_shape(rows: int, cols: int, block: Block | None) -> tuple[int, ...]:
    """The scales of an `[rows, cols]` weight: per channel, or per block."""
    if block is None:
        return (rows,)
    return (-(-rows // block[0]), -(-cols // block[1]))


def scale_shard(shard: Shard | None, block: Block | None) -> Shard | None:
    """Where a rank's scales lie in the checkpoint's, for a weight whose part is `shard` (None:
    the whole weight, and the whole scales)."""
    if shard is None:
        return None
    if block is None:
        return shard if shard.dim == 0 else None
    return whole_blocks(shard, block)


def whole_blocks(shard: Shard, block: Block) -> Shard:
    """`shard` of a weight as a part of its block scales along the same dim. ValueError naming
    `--tp-size` and the block size when the part does not consist of whole blocks."""
    size = block[shard.dim]
    end = shard.start + shard.size
    if shard.start % size or (end % size and end != shard.full):
        raise ValueError(
            f"--tp-size splits a weight's {shard.full} {'rows' if shard.dim == 0 else 'columns'} "
            f"at {shard.start}..{end}, inside FP8 blocks of {size} (the checkpoint's block size "
            f"{list(block)}): choose a --tp-size whose parts are whole blocks"
        )
    return Shard(shard.dim, shard.start // size, -(-shard.size // size), -(-shard.full // size))


def as_held(name: str, tensor: torch.Tensor, rows: int, block: Block | None) -> torch.Tensor:
    """A checkpoint tensor of parameter `name` as the model holds it. Weight scales
    (`*weight_scale`) float32: block scales as they are; per channel `[rows]` (from `[rows]` or
    `[rows, 1]`; a per-tensor scale repeated over the `rows` of the weight it scales). Input
    scales (`*input_scale`, per tensor: `[]` or `[1]`) as `[1]` float32. Others as they are."""
    if name.endswith("input_scale"):
        return tensor.float().reshape(-1)
    if not name.endswith("weight_scale"):
        return tensor
    if block is not None:
        return tensor.float()
    flat = tensor.float().reshape(-1)
    return flat.expand(rows) if flat.numel() == 1 else flat
