"""Prompt logprobs: each prompt token's log-probability given the tokens before it (and the k
most likely alternatives there), from the final hidden states of the prefill that caches it.

Position j's hidden state predicts token j + 1, so a prefill chunk covering positions [a, b)
scores the prompt tokens a + 1 .. b (the last prompt position predicts the first output token,
which sampling handles). Chunks of a chunked prefill each score their part; positions scored
once are not scored again when a retracted request's prompt is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replaylm.runtime.io_struct import TokenLogprob
from replaylm.runtime.request import PromptLogprobChunk, Req

if TYPE_CHECKING:
    from replaylm.model_executor.model_runner import ModelRunner

# rows projected to the vocabulary at a time: bounds the float32 [rows, V] logits in memory
_ROWS_PER_PROJECTION = 256


@dataclass
class PromptLogprobPlan:
    """Which hidden rows of one prefill batch to score, and for which requests."""

    token_index: list[int]  # flat token positions in the batch
    targets: list[int]  # the prompt token each row predicts
    spans: list[tuple[Req, int, int]]  # (request, first position, end position) in row order

    @classmethod
    def build(
        cls, reqs: list[Req], chunks: list[int], first_token: int = 0
    ) -> PromptLogprobPlan | None:
        """The plan for an EXTEND batch of `chunks[i]` new tokens of `reqs[i]` each, from token
        `first_token` of the batch on (after a mixed step's decode tokens), before the batch is
        prepared (each request's cached length is still its prefix); None when no request needs
        prompt scores in this batch."""
        token_index: list[int] = []
        targets: list[int] = []
        spans: list[tuple[Req, int, int]] = []
        offset = first_token
        for req, chunk in zip(reqs, chunks, strict=True):
            prefix = req.kv_len
            if req.prompt_logprobs is not None:
                start = max(prefix, req.prompt_logprobs_done)
                end = min(prefix + chunk, len(req.input_ids) - 1)
                if start < end:
                    token_index += range(offset + start - prefix, offset + end - prefix)
                    targets += req.input_ids[start + 1 : end + 1]
                    spans.append((req, start, end))
            offset += chunk
        return cls(token_index, targets, spans) if spans else None

    def score(self, runner: ModelRunner, hidden: torch.Tensor) -> None:
        """Score the planned rows (`hidden`: their final hidden states, in plan order) and add a
        chunk to each request; the host copies are started, not awaited."""
        k = max(req.prompt_logprobs or 0 for req, _, _ in self.spans)
        targets = torch.tensor(self.targets).to(hidden.device, non_blocking=True)
        chosen, top_vals, top_ids = [], [], []
        for rows in range(0, hidden.shape[0], _ROWS_PER_PROJECTION):
            part = slice(rows, rows + _ROWS_PER_PROJECTION)
            logprobs = torch.log_softmax(runner.token_logits(hidden[part]), dim=-1)
            chosen.append(logprobs.gather(1, targets[part, None])[:, 0])
            vals, ids = logprobs.topk(k, dim=-1)
            top_vals.append(vals)
            top_ids.append(ids)
        host = [torch.cat(t).to("cpu", non_blocking=True) for t in (chosen, top_vals, top_ids)]
        row = 0
        for req, start, end in self.spans:
            rows_of = slice(row, row + end - start)
            req.prompt_logprob_chunks.append(
                PromptLogprobChunk(start, end, *(t[rows_of] for t in host))
            )
            row += end - start


def prompt_token_logprobs(req: Req) -> list[TokenLogprob | None]:
    """The request's prompt logprobs, one entry per prompt token (None for the first)."""
    out: list[TokenLogprob | None] = [None]
    k = req.prompt_logprobs or 0
    for chunk in req.prompt_logprob_chunks:
        targets = req.input_ids[chunk.start + 1 : chunk.end + 1]
        chosen = chunk.chosen.tolist()
        top_ids, top_vals = chunk.top_ids[:, :k].tolist(), chunk.top_vals[:, :k].tolist()
        for i, token in enumerate(targets):
            top = list(zip(top_ids[i], top_vals[i], strict=True))
            out.append(TokenLogprob(token, chosen[i], top))
    return out
