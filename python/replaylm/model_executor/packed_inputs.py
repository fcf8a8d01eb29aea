"""How a batch's host-built index fields reach the device: packed into one buffer, one copy.

`ForwardBatch.create` packs nine int64 fields (`PACKED_FIELDS`, in that order) and the new
tokens' int32 KV slots. `send_packed` sends them to a fresh device buffer. `GraphInputs` is a
persistent device buffer of that layout for the batches one graph shape replays: a graph captured
over its fields reads each later batch built there, so its replay copies nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from itertools import accumulate

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
TOKEN_FIELDS = 4
# the packed fields a ForwardBatch keeps (the table index is only written into the table)
BATCH_FIELDS = tuple(n for n in PACKED_FIELDS if n != "table_index")


def host_fields(
    new_token_ids: list[list[int]],
    prefix_lens: list[int],
    rows: list[int],
    slots: Sequence[int],
    row_width: int,
    first_token: int = 0,
) -> list[list[int]]:
    """Requests' `PACKED_FIELDS` as host lists: request i's tokens `new_token_ids[i]` at
    positions `prefix_lens[i]..` of request-table row `rows[i]` (a row `row_width` entries long),
    their KV slots `slots` in the same packed order, its first token at `first_token` plus the
    tokens of the requests before it."""
    ext = [len(t) for t in new_token_ids]
    seq = [p + n for p, n in zip(prefix_lens, ext, strict=True)]
    spans = list(zip(rows, prefix_lens, seq, strict=True))
    starts = list(accumulate(ext, initial=first_token))
    starts.pop()
    return [
        [t for ids in new_token_ids for t in ids],
        [j for _, p, s in spans for j in range(p, s)],
        list(slots),
        [r * row_width + j for r, p, s in spans for j in range(p, s)],
        list(rows),
        seq,
        list(prefix_lens),
        ext,
        starts,
    ]


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


class GraphInputs:
    """The persistent device home of the batches one graph shape replays: `num_tokens` tokens
    (live ones, then padding) over at most `max_requests` requests. One buffer laid out as
    `ForwardBatch.create` packs a batch, `fields` (the nine `PACKED_FIELDS`, int64: the token
    fields `num_tokens` long, the request fields `max_requests` long, so every field keeps its
    address whatever the number of requests) then `slots32` (int32, per token).

    Padding: the tokens after the live ones form requests of at most `pad_span` tokens each
    (token 0 at positions 0.. of the request table's all-zero `padding_row`, writing KV slot 0),
    so they read and write nothing live. A decode shape pads with one-token requests.

    A batch built here stays valid until the next one is: `load` overwrites the buffer in stream
    order, so work queued before reads its own batch's values, and a host that builds one batch
    per step (as the scheduler does) never sees two.
    """

    def __init__(
        self,
        num_tokens: int,
        max_requests: int,
        pad_span: int,
        padding_row: int,
        device: torch.device,
    ) -> None:
        if num_tokens < 1 or max_requests < 1 or pad_span < 1:
            raise ValueError(
                f"graph inputs need tokens, requests and a padding span, got {num_tokens}, "
                f"{max_requests}, {pad_span}"
            )
        self.num_tokens, self.max_requests = num_tokens, max_requests
        self.pad_span, self.padding_row = pad_span, padding_row
        sizes = [num_tokens] * TOKEN_FIELDS + [max_requests] * (len(PACKED_FIELDS) - TOKEN_FIELDS)
        wide_bytes = 8 * sum(sizes)
        self.buffer = torch.zeros(wide_bytes + 4 * num_tokens, dtype=torch.uint8, device=device)
        wide, narrow = self.buffer.split_with_sizes([wide_bytes, 4 * num_tokens])
        self.fields: tuple[torch.Tensor, ...] = tuple(wide.view(torch.int64).split(sizes))
        self.slots32 = narrow.view(torch.int32)
        self._views = {(num_tokens, max_requests): self.fields}

    def field(self, name: str) -> torch.Tensor:
        return self.fields[PACKED_FIELDS.index(name)]

    def views(self, num_tokens: int, num_requests: int) -> tuple[torch.Tensor, ...]:
        """The fields' first `num_tokens` / `num_requests` entries (made once per pair: slicing
        costs host time)."""
        key = (num_tokens, num_requests)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = tuple(
                f[: num_tokens if i < TOKEN_FIELDS else num_requests]
                for i, f in enumerate(self.fields)
            )
        return views

    def holds(self, input_ids: torch.Tensor) -> bool:
        """Whether a batch with these `input_ids` was built here."""
        return input_ids.data_ptr() == self.fields[0].data_ptr()

    def padding_requests(
        self, live_tokens: int, live_requests: int
    ) -> tuple[list[list[int]], list[int], list[int], list[int]]:
        """(token ids, prefix lengths, request rows, KV slots) of the padding requests after a
        live batch: token 0 at positions 0.. of the padding row, KV slot 0, at most `pad_span`
        tokens each. ValueError where the live batch and its padding do not fit."""
        sizes = self.padding_sizes(live_tokens)
        if live_requests + len(sizes) > self.max_requests:
            raise ValueError(
                f"graph inputs of {self.max_requests} requests cannot hold "
                f"{live_requests + len(sizes)} requests"
            )
        n = len(sizes)
        return [[0] * size for size in sizes], [0] * n, [self.padding_row] * n, [0] * sum(sizes)

    def padding_sizes(self, live_tokens: int) -> list[int]:
        """The new tokens of each padding request after `live_tokens` live ones."""
        pad = self.num_tokens - live_tokens
        if pad < 0:
            raise ValueError(f"graph inputs of {self.num_tokens} tokens cannot hold {live_tokens}")
        full, rest = divmod(pad, self.pad_span)
        return [self.pad_span] * full + ([rest] if rest else [])

    def load(self, host: torch.Tensor) -> None:
        """One copy of a `pack_host` buffer of this layout into the device buffer."""
        self.buffer.copy_(host, non_blocking=True)

    def copy_in(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Copy the `BATCH_FIELDS` of a batch built elsewhere in, padded (not a scheduler's
        path: its batches are built here; a few copies more)."""
        tokens, reqs = len(batch["input_ids"]), len(batch["seq_lens"])
        # the padding's table entries are the padding row's already: its table index goes unused
        pad = host_fields(*self.padding_requests(tokens, reqs), row_width=0, first_token=tokens)
        live = self.views(tokens, reqs)
        dsts = [live[PACKED_FIELDS.index(n)] for n in BATCH_FIELDS]
        torch._foreach_copy_(dsts, [batch[n] for n in BATCH_FIELDS], non_blocking=True)
        if not pad[0]:
            return
        srcs = [pad[PACKED_FIELDS.index(n)] for n in BATCH_FIELDS]
        host = torch.tensor([v for values in srcs for v in values], dtype=torch.int64)
        pad_dsts = [
            self.field(n)[tokens : tokens + len(values)]
            if PACKED_FIELDS.index(n) < TOKEN_FIELDS
            else self.field(n)[reqs : reqs + len(values)]
            for n, values in zip(BATCH_FIELDS, srcs, strict=True)
        ]
        parts = host.split([len(values) for values in srcs])
        torch._foreach_copy_(pad_dsts, list(parts), non_blocking=True)
