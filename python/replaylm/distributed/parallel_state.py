"""The tensor-parallel group of this process: its rank, the group's size, and the
torch.distributed process groups (the device's backend for the model's collectives, gloo for the
Python objects rank 0 sends the others). Without `init_tensor_parallel` a process is rank 0 of 1
and makes no collective."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from replaylm.distributed.peer_all_reduce import ONE_SHOT_MAX_BYTES, PeerAllReduce

logger = logging.getLogger(__name__)

# how long a collective may wait for a rank; a rank that dies closes its connections, which
# fails the others' collectives at once, so this bounds only a rank that hangs
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class TPPlace:
    """A rank's place in its tensor-parallel group (rank 0 of 1 without tensor parallelism).
    `expert_parallel` (`--enable-expert-parallel`): a mixture-of-experts layer places whole
    experts on the ranks rather than a slice of every expert (`layers.moe.layer.FusedMoE`)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False


@dataclass(frozen=True)
class TPGroup:
    """An initialised tensor-parallel group: `device_group` (NCCL on CUDA, gloo on the CPU)
    carries the model's collectives, `cpu_group` (gloo) the objects rank 0 broadcasts, and
    `peer_all_reduce` (with `--tp-all-reduce one-shot`) the small sums fused with their norm."""

    place: TPPlace
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    peer_all_reduce: PeerAllReduce | None = None


_group: TPGroup | None = None


def tp_place() -> TPPlace:
    """This process's place: rank 0 of 1 unless `init_tensor_parallel` ran."""
    return _group.place if _group is not None else TPPlace()


def shows_progress() -> bool:
    """Whether this process draws progress bars: rank 0 does, the other ranks (doing the same
    steps at the same time) would only repeat them."""
    return tp_place().rank == 0


def tp_group() -> TPGroup:
    """The initialised group; RuntimeError outside tensor parallelism (a collective with no
    group is a bug, never a silent no-op)."""
    if _group is None:
        raise RuntimeError("no tensor-parallel group: init_tensor_parallel was not called")
    return _group


def init_tensor_parallel(
    rank: int,
    size: int,
    init_addr: str,
    device: torch.device,
    one_shot_dtype: torch.dtype | None = None,
    expert_parallel: bool = False,
) -> TPGroup:
    """Join the group of `size` ranks as `rank`, meeting at `init_addr` (`host:port`, served by
    rank 0). Called once per process, before the model is built. `one_shot_dtype` (CUDA only):
    the model's dtype, whose small sums go over peer memory (`PeerAllReduce`).
    `expert_parallel`: the place's (`TPPlace`), which the model is built for."""
    global _group
    if _group is not None:
        raise RuntimeError("the tensor-parallel group is already initialised")
    backend = "nccl" if device.type == "cuda" else "gloo"
    # NCCL's heartbeat monitor polls rank 0's TCPStore; at shutdown rank 0 leaves first and the
    # others' monitors print C++ frames. A dead rank already fails the gloo broadcasts at once.
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    world = dist.group.WORLD
    assert world is not None  # init_process_group made it
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo")
    peer = None if one_shot_dtype is None else PeerAllReduce(world, device, one_shot_dtype)
    _group = TPGroup(TPPlace(rank, size, expert_parallel), world, cpu_group, peer)
    logger.info(
        "tensor parallelism: rank %d of %d (pid %d) on %s (%s collectives%s, group met at %s)%s",
        rank,
        size,
        os.getpid(),
        device,
        backend,
        f", one-shot sums up to {ONE_SHOT_MAX_BYTES // 1024} KiB over peer memory"
        if peer is not None
        else "",
        init_addr,
        "; experts placed whole (expert parallelism)" if expert_parallel else "",
    )
    return _group


def destroy_tensor_parallel() -> None:
    """Leave the group (a process that ends without it may warn about leaked groups)."""
    global _group
    if _group is not None:
        _group = None  # and with it the peer buffer, freed while its group still stands
        dist.destroy_process_group()
