"""Decode graphs: one per batch size; each request feeds exactly one token."""

from __future__ import annotations

from typing import Any

import torch

from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode


class DecodeCudaGraphRunner(BaseCudaGraphRunner):
    """Shape key: the batch size. Padding requests sit at the end: one token each, over the
    padding row, writing KV slot 0."""

    phase = "decode"
    mode = ForwardMode.DECODE
    shape_unit, max_shape_flag = "requests", "--decode-cuda-graph-max-bs"
    padding_span = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.context.model
        # every shape writes its logits here: one [max_bs, V] buffer instead of one per shape
        self._logits = torch.empty(
            self.shapes[-1], model.logits_width, dtype=torch.float32, device=self.device
        )

    def shape_tokens(self, shape: int) -> int:
        return shape

    def shape_requests(self, shape: int) -> int:
        return shape

    def shape_key(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> int | None:
        return batch_size if mode.is_decode() else None

    def forward_fn(self, batch: ForwardBatch) -> torch.Tensor:
        """The whole forward, logits included (the batch size is fixed per shape), written by the
        LM head straight into the logits buffer all shapes share."""
        model = self.context.model
        return model.compute_logits(
            self.backend.forward_hidden(model, batch), batch, out=self._logits[: batch.batch_size]
        )

    def finish(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        return output if output.shape[0] == bs else output[:bs]  # slicing costs host time
