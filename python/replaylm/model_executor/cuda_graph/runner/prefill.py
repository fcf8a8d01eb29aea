"""Prefill graphs: one per token-count bucket; any mix of requests whose new tokens sum to at
most the bucket (mixed steps' decode tokens included)."""

from __future__ import annotations

import torch

from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.static_buffers import StaticBuffers
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode


class PrefillCudaGraphRunner(BaseCudaGraphRunner):
    """Shape key: the number of new tokens. The padding tokens form extra requests at the end,
    each at most the context length long (over the padding row, positions 0.., all writing KV
    slot 0), so a bucket larger than the context length serves batches of several requests as
    well. Only a backend that runs attention outside the graph (breakable, tc_piecewise) can
    serve this phase."""

    phase = "prefill"
    shape_unit, max_shape_flag = "tokens", "--prefill-cuda-graph-max-tokens"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buffers = StaticBuffers.allocate(
            self.max_batch_size, self.max_num_tokens, self.model_runner.device
        )

    @property
    def padding_span(self) -> int:
        """The longest padding request: the request table's row and the positions end there."""
        return self.model_runner.context_len

    def buffer_sizes(self) -> tuple[int, int]:
        most_padding = -(-self.shapes[-1] // self.padding_span)
        return self.model_runner.max_running_requests + most_padding, self.shapes[-1]

    def shape_key(self, batch: ForwardBatch) -> int | None:
        running = self.model_runner.max_running_requests
        if not batch.forward_mode.is_extend() or batch.batch_size > running:
            return None
        return batch.num_tokens

    def forward_fn(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the bucket's tokens: the number of requests varies between replays
        of one bucket, so the per-request logits are computed after the replay."""
        return self.backend.forward_hidden(self.model_runner.model, batch)

    def finish(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model_runner.model.compute_logits(output[: batch.num_tokens], batch)

    def fill_buffers(self, batch: ForwardBatch | None, shape: int) -> ForwardBatch:
        buf = self.buffers
        live_tokens = batch.num_tokens if batch is not None else 0
        live_reqs = batch.batch_size if batch is not None else 0
        if batch is not None:
            for name in ("input_ids", "positions", "out_cache_loc"):
                getattr(buf, name)[:live_tokens].copy_(getattr(batch, name), non_blocking=True)
            for name in (
                "req_pool_indices",
                "seq_lens",
                "prefix_lens",
                "extend_seq_lens",
                "extend_start_loc",
            ):
                getattr(buf, name)[:live_reqs].copy_(getattr(batch, name), non_blocking=True)
        seq_cpu = list(batch.seq_lens_cpu) if batch is not None else []
        ext_cpu = list(batch.extend_seq_lens_cpu) if batch is not None else []
        start, i = live_tokens, live_reqs
        while start < shape:  # padding requests of at most `padding_span` tokens
            n = min(shape - start, self.padding_span)
            tokens = slice(start, start + n)
            buf.input_ids[tokens] = 0
            torch.arange(n, out=buf.positions[tokens])
            buf.out_cache_loc[tokens] = 0
            buf.req_pool_indices[i] = self.padding_row
            buf.seq_lens[i] = n
            buf.prefix_lens[i] = 0
            buf.extend_seq_lens[i] = n
            buf.extend_start_loc[i] = start
            seq_cpu.append(n)
            ext_cpu.append(n)
            start, i = start + n, i + 1
        return buf.view(
            ForwardMode.EXTEND,
            len(seq_cpu),
            shape,
            seq_cpu,
            ext_cpu,
            self.model_runner,
            batch.num_decode if batch is not None else 0,
        )
