"""The collectives of tensor parallelism: plain torch.distributed calls over the group's device
backend (capturable in CUDA graphs with NCCL), and the broadcast of Python objects from rank 0
over its gloo group."""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import torch
import torch.distributed as dist

from replaylm.distributed.parallel_state import destroy_tensor_parallel, tp_group
from replaylm.distributed.peer_all_reduce import PeerAllReduce


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks: `x` itself, summed in place by the device group's
    all-reduce."""
    dist.all_reduce(x, group=tp_group().device_group)
    return x


def one_shot_peer(x: torch.Tensor, residual: torch.Tensor) -> PeerAllReduce | None:
    """The group's peer buffer where it sums `x` (with `residual`) in the one-shot kernel
    (`--tp-all-reduce one-shot`, `x` suits it); None otherwise, and always while torch.compile
    traces (the all-reduce is the traceable collective), for the caller to all-reduce."""
    peer = tp_group().peer_all_reduce
    if peer is None or torch.compiler.is_compiling() or not peer.takes(x, residual):
        return None
    return peer


def all_gather_columns(x: torch.Tensor) -> torch.Tensor:
    """`[N, C]` on every rank -> `[N, size * C]`, rank r's columns at `r * C`."""
    group = tp_group()
    parts = [torch.empty_like(x) for _ in range(group.place.size)]
    dist.all_gather(parts, x.contiguous(), group=group.device_group)
    return torch.cat(parts, dim=-1)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` becomes rank 0's, in place; returns `x`."""
    dist.broadcast(x, src=0, group=tp_group().device_group)
    return x


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (over the gloo group: a start-up agreement)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp_group().cpu_group)
    return int(t.item())


def part_together() -> None:
    """At shutdown, on every rank: wait until every rank has taken rank 0's last broadcast (a
    rank that left at once could close its connections while another still reads it, which
    that rank would take for a peer's death), then leave the group together (NCCL's teardown
    waits for every rank's). A rank already gone is no error at the barrier."""
    with contextlib.suppress(RuntimeError):
        dist.barrier(group=tp_group().cpu_group)
    destroy_tensor_parallel()


class GroupBroken(RuntimeError):
    """A collective of the schedulers' loop failed: another rank is gone (its process died or
    its connection closed)."""


def broadcast_objects(objects: list[Any] | None) -> list[Any]:
    """Rank 0's `objects` on every rank (the others pass None). One collective for an empty
    list (the common case: a scheduler step with no new requests), two otherwise. GroupBroken
    when a rank is gone."""
    try:
        return _broadcast_objects(objects)
    except RuntimeError as err:  # gloo's error for a closed connection is a plain RuntimeError
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GroupBroken(f"a tensor-parallel rank is gone: {first_line}") from err


def _broadcast_objects(objects: list[Any] | None) -> list[Any]:
    group = tp_group()
    rank0 = group.place.rank == 0
    payload = pickle.dumps(objects) if rank0 and objects else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group.cpu_group)
    if not size.item():
        return []
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if rank0
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(data, src=0, group=group.cpu_group)
    return list(objects or []) if rank0 else pickle.loads(data.numpy().tobytes())
