"""A one-shot all-reduce over peer memory (`--tp-all-reduce one-shot`): every rank copies its
part into a buffer of torch's symmetric memory, and each rank's kernel reads every peer's buffer
over NVLink and sums, in one launch with no multicast. A decode step's all-reduces are a few KiB
to a few hundred KiB, where NCCL's protocol costs more than moving the bytes; larger messages
stay with NCCL."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

# the largest message the one-shot kernel takes: each rank reads (ranks - 1) times this over
# NVLink, which stops paying against NCCL's ring somewhere around here on an H100 host
ONE_SHOT_MAX_BYTES = 512 * 1024
ALIGNMENT = 16  # bytes: the kernel moves 16-byte vectors
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PeerAllReduce:
    """The symmetric buffer of one tensor-parallel group and the one-shot sum over it. Built
    on every rank of the group at once (the buffer's rendezvous is a collective)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` fits the one-shot kernel (else NCCL sums it)."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in DTYPES
            and x.is_contiguous()
            and nbytes <= ONE_SHOT_MAX_BYTES
            and nbytes % ALIGNMENT == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in a new tensor."""
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            staged, x, "sum", self.group_name, out
        )
