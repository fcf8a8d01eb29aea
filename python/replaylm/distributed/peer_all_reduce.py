"""The peer-memory buffer behind `--tp-all-reduce one-shot`: each layer's sum of partial outputs,
residual add and RMSNorm in one launch (`layers/kernels/peer_sum_norm.py`), for messages up to
`ONE_SHOT_MAX_BYTES` (decode steps). A decode step's sums are a few KiB to a few hundred KiB,
where NCCL's protocol costs more than moving the bytes; larger ones stay with NCCL.

The buffer is torch's symmetric memory (every rank maps every other rank's over NVLink; no
multicast). It holds two slots, each a region per rank of `ONE_SHOT_MAX_BYTES`. A call takes the
slot of its site's parity: the model numbers its sums 0, 1, 2, ... in the order a forward makes
them, an even count, so consecutive calls always take different slots, also from one forward to
the next and from one captured graph to another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

# the largest message (one rank's partial sums) the one-shot kernel takes: each rank writes
# (ranks - 1) times this over NVLink, which stops paying against NCCL's ring around here
ONE_SHOT_MAX_BYTES = 512 * 1024
MAX_WIDTH = 16384  # the widest row one program holds
SLOTS = 2
# the empty mark per element width: -0.0's bits as a signed integer
EMPTY_MARK = {2: -(1 << 15), 4: -(1 << 31)}
_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}
# whether a PeerAllReduce was built in this process: torch's symmetric memory keeps per-process
# rendezvous state (keyed by group name, numbered exchanges), so a process meets peers over it
# once; a later group whose other ranks are fresh processes would wait for them forever
_met_peers = False


def mark_empty(buffer: torch.Tensor, width: int) -> None:
    """Fill `buffer` (any dtype, its byte size a multiple of `width`) with the empty mark of
    elements `width` bytes wide."""
    buffer.view(torch.uint8).view(_INT_OF_WIDTH[width]).fill_(EMPTY_MARK[width])


def choose_all_reduce(
    choice: str,
    device: torch.device,
    tp_size: int,
    ranks_per_node: int,
    peer_access: Callable[[int, int], bool] = torch.cuda.can_device_access_peer,
) -> tuple[str, str]:
    """`--tp-all-reduce` resolved to "nccl" or "one-shot", and why. auto takes one-shot where
    every rank's GPU can write every other's memory: CUDA GPUs of one machine (devices 0 to
    `ranks_per_node` - 1, one per rank), each pair with peer access; else NCCL."""
    if choice != "auto":
        return choice, "as asked"
    if device.type != "cuda":
        return "nccl", f"auto: no peer memory on {device.type}"
    if ranks_per_node < tp_size:
        return "nccl", "auto: the ranks span several machines"
    gpus = range(ranks_per_node)
    if not all(peer_access(a, b) for a in gpus for b in gpus if a != b):
        return "nccl", "auto: some of the GPUs cannot reach each other's memory"
    return "one-shot", f"auto: {tp_size} GPUs of one machine with peer access"


def met_peers() -> bool:
    """Whether this process has built a PeerAllReduce (met a group's peers over peer memory)."""
    return _met_peers


def all_reduce_for_rank_zero(choice: str, met_before: bool) -> tuple[str, str | None]:
    """`--tp-all-reduce` for a group whose rank 0 is a long-lived process (the offline
    Engine's), decided before the other ranks start so that all take the same: `choice`, or,
    where a group of that process met over peer memory before (`met_before`), nccl for auto
    (and why). ValueError naming the field for one-shot then."""
    if not met_before or choice == "nccl":
        return choice, None
    if choice == "one-shot":
        raise ValueError(
            "tp_all_reduce: 'one-shot' can serve one tensor-parallel group per process (torch's "
            "symmetric memory meets its peers once), and an earlier Engine here used it: "
            "give 'nccl' or 'auto', or start a new process"
        )
    return "nccl", (
        "auto: an earlier group of this process met over peer memory, which torch meets once "
        "per process"
    )


class PeerAllReduce:
    """The symmetric buffer of one tensor-parallel group for one dtype, which the fused sum's
    kernel runs over. Built on every rank of the group at once (the buffer's rendezvous is a
    collective)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.rank = group.rank()
        ranks = group.size()
        self.region_elems = ONE_SHOT_MAX_BYTES // dtype.itemsize
        self.buffer = symm_mem.empty(SLOTS * ranks * self.region_elems, dtype=dtype, device=device)
        mark_empty(self.buffer, dtype.itemsize)
        global _met_peers
        _met_peers = True
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        slot_bytes = ranks * ONE_SHOT_MAX_BYTES
        self.regions = [
            torch.tensor(
                [ptr + slot * slot_bytes for ptr in handle.buffer_ptrs],
                dtype=torch.int64,
                device=device,
            )
            for slot in range(SLOTS)
        ]
        self.max_programs = torch.cuda.get_device_properties(device).multi_processor_count
        torch.cuda.synchronize(device)
        dist.barrier(group)  # no rank writes into a buffer before its owner has marked it empty

    def takes(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether `x` (with `residual`) suits the one-shot kernel (else NCCL sums it)."""
        return (
            x.dtype == self.dtype
            and x.dim() == 2
            and x.stride(-1) == 1
            and x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES
            and x.shape[-1] <= MAX_WIDTH
            and residual.shape == x.shape
            and residual.stride(-1) == 1
        )
