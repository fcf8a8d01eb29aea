"""Selects the hidden state that predicts each request's next token and projects it to logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from replaylm.distributed.communication import all_gather_columns
from replaylm.layers.linear import MatmulLayer, linear
from replaylm.layers.vocab_embedding import VocabRows

if TYPE_CHECKING:
    from replaylm.model_executor.forward_batch import ForwardBatch


class LMHead(VocabRows):
    """An untied LM head: its `[V, H]` weight only (checkpoint name `lm_head.weight`), or this
    rank's rows of it; the projection is LogitsProcessor's, so the head is no MatmulLayer of its
    own."""


class LogitsProcessor(MatmulLayer):
    """`hidden [T, H] -> logits [B, V]` (float32): the last new token of every request (every
    token, `[T, V]`, in a verify batch, which checks each draft token); written into `out`
    (contiguous, that shape, float32) when given, e.g. a buffer that every decode graph shares
    (no copy after the matmul)."""

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.project(self.select(hidden, batch), lm_head_weight, out)

    @staticmethod
    def select(hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The rows of `hidden [T, H]` that predict a next token: each request's last new
        token (every token of a decode-shaped batch)."""
        if batch.forward_mode.is_decode_shaped():
            return hidden
        return hidden[batch.extend_start_loc + batch.extend_seq_lens - 1]

    def project(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits `[N, V]` (float32) of every row of `hidden [N, H]`."""
        return linear(hidden, lm_head_weight, None, self.matmul, out_dtype=torch.float32, out=out)


class VocabParallelLogitsProcessor(LogitsProcessor):
    """The projection with the LM head's rows split over the ranks: each rank computes its
    slice of the vocabulary's logits, gathered once (all-gather) and cut to `vocab_size` (the
    last slice's padding)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def project(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        local = linear(hidden, lm_head_weight, None, self.matmul, out_dtype=torch.float32)
        logits = all_gather_columns(local)[:, : self.vocab_size]
        return logits.contiguous() if out is None else out.copy_(logits)
