"""Request-to-token table: row r lists the KV slot of every token of the request in row r."""

from __future__ import annotations

import torch

from replaylm.mem_cache.errors import OutOfRequestSlotsError


class ReqToTokenPool:
    """A `[max_reqs + 1, max_context_len]` int32 table plus a free list of rows.

    Row contents are written by the caller (`write`, a batch at a time) as tokens get KV slots; a
    freed row is reused as is (stale contents are overwritten before they are read again). The
    extra last row, `padding_row`, is never allocated and stays all zeros (KV slot 0, the padding
    slot): padding requests of a CUDA graph point at it.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError("request table needs at least one row and one column")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.row_width = max_context_len  # entry (row, position) is at row * row_width + position
        self.padding_row = max_reqs
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context_len), dtype=torch.int32, device=device
        )
        self.device = self.req_to_token.device
        self._entries = self.req_to_token.view(-1)  # made once: a view is host time per write
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, need: int = 1) -> list[int]:
        """Reserve `need` rows; raises OutOfRequestSlotsError when too few are free."""
        if need > len(self._free_rows):
            raise OutOfRequestSlotsError(need, len(self._free_rows))
        return [self._free_rows.pop() for _ in range(need)]

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_reqs or row in self._free_rows:
            raise ValueError(f"request row {row} is not allocated")
        self._free_rows.append(row)

    def check_fits(self, end: int) -> None:
        """Raise ValueError when a request would hold `end` tokens, more than a row has."""
        if end > self.max_context_len:
            raise ValueError(f"position {end} exceeds the context length {self.max_context_len}")

    def write(self, index: torch.Tensor, slots: torch.Tensor) -> None:
        """Record `slots[i]` (int32) at flat entry `index[i]` (int64, `row * row_width +
        position`) of the table, on its device: one launch for a whole batch. Entries are not
        checked here (that would read them back from the device): callers check lengths on the
        host first (`check_fits`)."""
        self._entries.index_copy_(0, index, slots)

    def slots(self, row: int, start: int, end: int) -> list[int]:
        """KV slots of tokens start..end-1 of request `row` (read back from the device)."""
        return self.req_to_token[row, start:end].tolist()
