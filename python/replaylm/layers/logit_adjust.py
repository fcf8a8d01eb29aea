"""Per-request changes to the logits before sampling: penalties, logit_bias, min_tokens,
banned and allowed token ids.

In the order applied to a row's float32 logits (vLLM's order for the penalties):
- repetition_penalty `r` (vLLM / HF): every token seen in the prompt or the output so far gets
  `logit / r` where its logit is > 0, `logit * r` otherwise;
- frequency_penalty `f`, presence_penalty `p` (OpenAI, over the output tokens only):
  `logit - f * count`, then `- p * (count > 0)`;
- logit_bias: its value added to its token's logit;
- min_tokens: while fewer than min_tokens tokens are out, the EOS ids and the request's
  stop_token_ids get -inf (also with `ignore_eos`);
- banned_token_ids: -inf;
- allowed_token_ids: every other id gets -inf (the allowed ids keep their adjusted logits).
A row at the neutral values keeps its logits bit for bit (x / 1, x * 1 and x - 0 are exact), so
plain requests in a penalised batch sample what they sample alone. The adjusted logits are what
the sampler sees (greedy rows included); logprobs are computed from the model's raw logits.

The penalties need state on the device, kept per request-table row (`Req.req_pool_idx`): each
row's output-token counts (int32 `[rows, V]`) and a prompt-token mask (bool `[rows, V]`). It is
allocated the first time a penalised request appears, so a server that never sees one pays no
memory; then it holds `rows * V * 5` bytes (256 rows of a 152k vocabulary: about 195 MB). A
row's state is written whole from the host (prompt ids, output ids so far) when its request
gets its first sampled token (`init_requests`: after its prefill, after its re-prefill following
a retraction, for each choice forked from one prefill), and each step's sampled ids are added
on the device after sampling (`LogitAdjustments.record`), so a decode step launched before the
previous one is read back sees every earlier token. A released row needs nothing: whoever takes
it next is initialised before it is sampled; the rows of plain requests hold stale counts that
their neutral values ignore.

A batch without penalties, bias, banned or allowed ids or active min_tokens gets no
`LogitAdjustments` (no launch, no copy). Host-built per-step tensors cross to the device with
non-blocking copies (from pinned memory on CUDA), so nothing here waits for the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from replaylm.layers.kernels import use_triton_kernels
from replaylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AdjustedRequest(Protocol):
    """What the adjuster reads of a request (runtime.request.Req has it)."""

    @property
    def input_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def req_pool_idx(self) -> int | None: ...

    @property
    def sampling_params(self) -> SamplingParams: ...


def _on_device(data: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` on `device` by a non-blocking copy (staged in pinned memory for CUDA, whose
    caching host allocator keeps the buffer until the copy has run)."""
    host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    penalties: torch.Tensor,
) -> torch.Tensor:
    """A new float32 `[B, V]`: `logits` `[B, V]` with the penalties of batch row i computed
    from `counts[rows[i]]` (int32) and `prompt_mask[rows[i]]` (bool); `penalties` float32
    `[3, B]` holds each row's repetition, frequency and presence penalty. One Triton launch where
    the kernels run (bit-equal), the torch code elsewhere."""
    if use_triton_kernels(logits):
        from replaylm.layers.kernels.penalties import apply_penalties_kernel

        return apply_penalties_kernel(logits.contiguous(), counts, prompt_mask, rows, penalties)
    counts = counts.index_select(0, rows)
    seen = prompt_mask.index_select(0, rows) | (counts > 0)
    repetition, frequency, presence = (p.unsqueeze(1) for p in penalties)
    logits = torch.where(
        seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits
    )
    logits = logits - frequency * counts
    return logits - presence * (counts > 0)


@dataclass
class LogitAdjustments:
    """One step's adjustments of a batch's logits (built by `LogitAdjuster.adjustments`).

    rows: int64 `[B]` request-table rows and penalties float32 `[3, B]` (repetition, frequency,
    presence), both None when no request of the batch has a penalty; `sparse_index` int64 `[N]`
    (flat indices into the `[B, V]` logits) and `sparse_values` float32 `[N]`: logit_bias
    values and -inf for the banned ids and those min_tokens holds back, one entry per (row,
    token), or None; `allowed_rows` int64 `[R]` (the batch rows with allowed_token_ids) and
    `allowed_index` int64 `[M]` (flat indices of their allowed ids), or None.
    """

    adjuster: LogitAdjuster
    rows: torch.Tensor | None
    penalties: torch.Tensor | None
    sparse_index: torch.Tensor | None
    sparse_values: torch.Tensor | None
    allowed_rows: torch.Tensor | None
    allowed_index: torch.Tensor | None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits, a new tensor (`logits` is left as it is, for the logprobs)."""
        if self.rows is not None and self.penalties is not None:
            counts, prompt_mask = self.adjuster.state()
            out = apply_penalties(logits, counts, prompt_mask, self.rows, self.penalties)
        else:
            out = logits.clone(memory_format=torch.contiguous_format)
        if self.sparse_index is not None and self.sparse_values is not None:
            out.view(-1).index_add_(0, self.sparse_index, self.sparse_values)
        if self.allowed_rows is not None and self.allowed_index is not None:
            # keep the allowed ids' adjusted logits across the fill of their rows
            kept = out.view(-1).index_select(0, self.allowed_index)
            out.index_fill_(0, self.allowed_rows, -torch.inf)
            out.view(-1).index_copy_(0, self.allowed_index, kept)
        return out

    def record(self, next_ids: torch.Tensor) -> None:
        """Count each row's sampled id (`next_ids` int64 `[B]`) in its request-table row's
        output counts: in a batch with penalties, every row (plain rows' counts are not read)."""
        if self.rows is not None:
            self.adjuster.count(self.rows, next_ids)


class LogitAdjuster:
    """The device state of the penalties (see the module docstring) for `num_rows` request-table
    rows over a `vocab_size` vocabulary, and the builder of each step's `LogitAdjustments`."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = device
        self._counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._ones: torch.Tensor | None = None

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts int32 `[rows, V]`, prompt mask bool `[rows, V]`), allocated on first use."""
        if self._counts is None or self._prompt_mask is None:
            shape = (self.num_rows, self.vocab_size)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            logger.info(
                "penalty state allocated for %d request rows: %.1f MiB",
                self.num_rows,
                self.memory_bytes / 2**20,
            )
        return self._counts, self._prompt_mask

    @property
    def memory_bytes(self) -> int:
        """Device memory the penalty state holds (0 until a penalised request came)."""
        return sum(
            t.numel() * t.element_size() for t in (self._counts, self._prompt_mask) if t is not None
        )

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add 1 to `counts[rows[i], token_ids[i]]` for each i (int64 device tensors; a row may
        repeat, with other tokens)."""
        counts, _ = self.state()
        if self._ones is None or self._ones.numel() < rows.numel():
            self._ones = torch.ones(
                max(rows.numel(), self.num_rows), dtype=torch.int32, device=self.device
            )
        flat = token_ids.add(rows, alpha=self.vocab_size)
        counts.view(-1).index_add_(0, flat, self._ones[: rows.numel()])

    def init_requests(self, reqs: Sequence[AdjustedRequest]) -> None:
        """Write the penalty state of the penalised requests among `reqs` from their prompt and
        output ids, in their current rows. Call when a request gets its first sampled token
        from a row (before sampling it); requests without penalties cost nothing."""
        penalised = [r for r in reqs if r.sampling_params.has_penalties]
        if not penalised:
            return
        counts, prompt_mask = self.state()
        rows: list[int] = []
        prompt: list[int] = []  # flat indices into the prompt mask
        out_rows: list[int] = []
        out_ids: list[int] = []
        for req in penalised:
            row = _row(req)
            rows.append(row)
            prompt += [row * self.vocab_size + t for t in req.input_ids]
            out_rows += [row] * len(req.output_ids)
            out_ids += req.output_ids
        ints = _on_device(rows + prompt + out_rows + out_ids, torch.int64, self.device)
        rows_t, prompt_t, out_t = ints.split([len(rows), len(prompt), 2 * len(out_rows)])
        counts.index_fill_(0, rows_t, 0)
        prompt_mask.index_fill_(0, rows_t, False)
        prompt_mask.view(-1).index_fill_(0, prompt_t, True)
        if out_rows:
            self.count(*out_t.view(2, -1))

    def adjustments(
        self, reqs: Sequence[AdjustedRequest], num_out: Sequence[int], eos_ids: frozenset[int]
    ) -> LogitAdjustments | None:
        """This step's adjustments of the batch `reqs` (in logits-row order), request i having
        `num_out[i]` tokens out before this step's; None when nothing changes any row. Two
        copies to the device (its integers, its floats), whatever the batch holds."""
        params = [r.sampling_params for r in reqs]
        if not any(
            n < p.min_tokens or p.adjusts_logits for p, n in zip(params, num_out, strict=True)
        ):
            return None
        rows: list[int] = []
        floats: list[float] = []
        penalised = any(p.has_penalties for p in params)
        if penalised:
            rows = [_row(r) for r in reqs]
            floats += [p.repetition_penalty for p in params]
            floats += [p.frequency_penalty for p in params]
            floats += [p.presence_penalty for p in params]
        sparse: dict[int, float] = {}  # flat index -> value: one entry per (row, token)
        allowed_rows: list[int] = []
        allowed: set[int] = set()  # flat indices (a set: index_copy_ takes no duplicates)
        vocab = self.vocab_size
        for i, (p, n) in enumerate(zip(params, num_out, strict=True)):
            for token, bias in p.logit_bias.items():
                sparse[i * vocab + token] = bias
            held = (*eos_ids, *p.stop_token_ids) if n < p.min_tokens else ()
            for token in (*p.banned_token_ids, *held):
                sparse[i * vocab + token] = -torch.inf
            if p.allowed_token_ids is not None:
                allowed_rows.append(i)
                allowed.update(i * vocab + t for t in p.allowed_token_ids)
        if not penalised and not sparse and not allowed_rows:
            return None  # min_tokens with no EOS or stop ids to hold back
        sizes = [len(rows), len(sparse), len(allowed_rows), len(allowed)]
        ints = _on_device(
            [*rows, *sparse, *allowed_rows, *sorted(allowed)], torch.int64, self.device
        )
        floats_t = _on_device(floats + list(sparse.values()), torch.float32, self.device)
        rows_t, sparse_t, allowed_rows_t, allowed_t = ints.split(sizes)
        penalties_t, values_t = floats_t.split([3 * len(rows), len(sparse)])
        return LogitAdjustments(
            self,
            rows_t if penalised else None,
            penalties_t.view(3, -1) if penalised else None,
            sparse_t if sparse else None,
            values_t if sparse else None,
            allowed_rows_t if allowed_rows else None,
            allowed_t if allowed_rows else None,
        )


def _row(req: AdjustedRequest) -> int:
    row = req.req_pool_idx
    assert row is not None, "a request is sampled only while it holds a request-table row"
    return row
