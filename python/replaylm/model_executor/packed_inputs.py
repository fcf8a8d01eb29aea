"""How a batch's host-built index fields reach the device: packed into one buffer, one copy.

`ForwardBatch.create` packs nine int64 fields (`PACKED_FIELDS`, in that order) and the new
tokens' int32 KV slots. `send_packed` sends them to a fresh device buffer. `DecodeInputs` is a
persistent device buffer of that layout for decode batches of one padded size: a graph captured
over its fields reads each later batch built there, so its replay copies nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

# ForwardBatch.create's packed order: four per-token fields, then five per-request ones
PACKED_FIELDS = (
    "input_ids",
    "positions",
    "out_cache_loc",
    "table_index",
    "req_pool_indices",
    "seq_lens",
    "prefix_lens",
    "extend_seq_lens",
    "extend_start_loc",
)


def pack_host(wide: Sequence[int], narrow: Sequence[int]) -> torch.Tensor:
    """`wide` as int64 then `narrow` as int32, in one host uint8 tensor. The `array` module packs
    them (a C loop, much cheaper per element than `torch.tensor` of a list)."""
    buffer = bytearray(array("q", wide))
    buffer += array("i", narrow)
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def send_packed(
    device: torch.device, wide: Sequence[int], narrow: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`wide` as int64, `narrow` as int32) on `device`, sent in one host-to-device copy; every
    step is one torch call (each costs host time)."""
    on_device = pack_host(wide, narrow).to(device, non_blocking=True)  # pageable: staged now
    head, tail = on_device.split_with_sizes([8 * len(wide), 4 * len(narrow)])
    return head.view(torch.int64), tail.view(torch.int32)


class DecodeInputs:
    """The persistent device home of decode batches padded to `size` requests (one token each):
    one buffer laid out as `ForwardBatch.create` packs such a batch, `fields` (the nine
    `PACKED_FIELDS`, int64, `size` each) then `slots32` (int32).

    A batch built here stays valid until the next one is: `load` overwrites the buffer in stream
    order, so work queued before reads its own batch's values, and a host that builds one batch
    per step (as the scheduler does) never sees two.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        if size < 1:
            raise ValueError(f"decode inputs need at least one request, got {size}")
        self.size = size
        wide_bytes = 8 * len(PACKED_FIELDS) * size
        self.buffer = torch.empty(wide_bytes + 4 * size, dtype=torch.uint8, device=device)
        wide, narrow = self.buffer.split_with_sizes([wide_bytes, 4 * size])
        self.fields: tuple[torch.Tensor, ...] = tuple(wide.view(torch.int64).split(size))
        self.slots32 = narrow.view(torch.int32)
        self._live: dict[int, tuple[torch.Tensor, ...]] = {size: self.fields}

    def field(self, name: str) -> torch.Tensor:
        return self.fields[PACKED_FIELDS.index(name)]

    def live(self, n: int) -> tuple[torch.Tensor, ...]:
        """The fields' first `n` entries (made once per `n`: slicing costs host time)."""
        views = self._live.get(n)
        if views is None:
            views = self._live[n] = tuple(f[:n] for f in self.fields)
        return views

    def holds(self, input_ids: torch.Tensor) -> bool:
        """Whether a batch with these `input_ids` was built here."""
        return input_ids.data_ptr() == self.fields[0].data_ptr()

    def load(self, host: torch.Tensor) -> None:
        """One copy of a `pack_host` buffer of this layout into the device buffer."""
        self.buffer.copy_(host, non_blocking=True)
