"""Prefill graphs: one per token-count bucket; any mix of requests whose new tokens sum to at
most the bucket (mixed steps' decode tokens included)."""

from __future__ import annotations

import torch

from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode


class PrefillCudaGraphRunner(BaseCudaGraphRunner):
    """Shape key: the number of new tokens. The padding tokens form extra requests at the end,
    each at most the context length long (over the padding row, positions 0.., all writing KV
    slot 0), so a bucket larger than the context length serves batches of several requests as
    well. Only a backend that runs attention outside the graph (breakable, tc_piecewise) can
    serve this phase."""

    phase = "prefill"
    mode = ForwardMode.EXTEND
    shape_unit, max_shape_flag = "tokens", "--prefill-cuda-graph-max-tokens"

    @property
    def padding_span(self) -> int:
        """The longest padding request: the request table's row and the positions end there."""
        return self.context.kv.context_len

    def shape_tokens(self, shape: int) -> int:
        return shape

    def shape_requests(self, shape: int) -> int:
        return self.context.kv.max_requests + -(-shape // self.padding_span)

    def shape_key(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> int | None:
        if not mode.is_extend() or batch_size > self.context.kv.max_requests:
            return None
        return num_tokens

    def forward_fn(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the bucket's tokens: the number of requests varies between replays
        of one bucket, so the per-request logits are computed after the replay."""
        return self.backend.forward_hidden(self.context.model, batch)

    def finish(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.context.model.compute_logits(output[: batch.num_tokens], batch)
