"""Masking the logits of constrained rows to the tokens their grammars allow next."""

from __future__ import annotations

import torch
import xgrammar as xgr

from replaylm.structured.grammar import RequestGrammar


class GrammarMask:
    """Fills a token bitmask on the host for the constrained rows of a batch (xgrammar's batch
    matcher, over several threads), copies it to the logits' device behind the work queued there
    and applies it there. One host buffer, reused: pinned on CUDA, so the copy does not hold the
    host; each fill first waits for the copy before it (long finished in practice)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last copy out of `_host`
        self._filler = xgr.BatchGrammarMatcher()

    def apply(
        self, logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]
    ) -> torch.Tensor:
        """A copy of `logits` [B, V] whose `rows` allow only what `grammars` (one per row, none
        done) allow next; the other rows are left as they are."""
        batch, vocab = logits.shape
        host = self._buffer(batch, vocab, logits.is_cuda)
        if self._copied is not None:
            self._copied.synchronize()
        self._filler.batch_fill_next_token_bitmask([g.matcher for g in grammars], host, rows)
        bitmask = host[:batch]
        if logits.is_cuda:
            bitmask = bitmask.to(logits.device, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows)
        return masked

    def _buffer(self, batch: int, vocab: int, pinned: bool) -> torch.Tensor:
        """The host bitmask, grown to at least `batch` rows of `vocab` bits."""
        shape = xgr.get_bitmask_shape(batch, vocab)
        host = self._host
        if host is None or host.shape[0] < batch or host.shape[1] != shape[1]:
            if self._copied is not None:
                self._copied.synchronize()  # the old buffer may still be read
            rows = max(batch, host.shape[0] if host is not None else 0)
            host = torch.empty((rows, shape[1]), dtype=xgr.bitmask_dtype, pin_memory=pinned)
            self._host = host
        return host
