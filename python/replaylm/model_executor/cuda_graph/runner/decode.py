"""Decode graphs: one per batch size; each request feeds exactly one token."""

from __future__ import annotations

import torch

from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.static_buffers import copy_all
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode

# the batch fields a decode graph reads from the static buffers
_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
           "prefix_lens")


class DecodeCudaGraphRunner(BaseCudaGraphRunner):
    """Shape key: the batch size. Padding requests sit at the end: seq_len 1 over the padding
    row, writing their one token to KV slot 0."""

    phase = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # every shape writes its logits here: one [max_bs, V] buffer instead of one per shape
        self._logits = torch.empty(
            self.max_batch_size, self.model_runner.config.vocab_size, dtype=torch.float32,
            device=self.model_runner.device,
        )
        # the same for every decode batch: one new token per request
        self.buffers.extend_seq_lens.fill_(1)
        torch.arange(self.max_batch_size, out=self.buffers.extend_start_loc)
        # each field's value for padding requests, copied in with the live batch's fields
        pad_values = {"req_pool_indices": self.padding_row, "seq_lens": 1}
        self._padding = {name: torch.full((self.max_batch_size,), pad_values.get(name, 0),
                                          dtype=torch.int64, device=self.model_runner.device)
                         for name in _FIELDS}
        self._targets: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def buffer_sizes(self) -> tuple[int, int]:
        return self.shapes[-1], self.shapes[-1]

    def shape_key(self, batch: ForwardBatch) -> int | None:
        return batch.batch_size if batch.forward_mode.is_decode() else None

    def forward_fn(self, batch: ForwardBatch) -> torch.Tensor:
        """The whole forward, logits included (the batch size is fixed per shape), written by the
        LM head straight into the logits buffer all shapes share."""
        model = self.model_runner.model
        return model.compute_logits(self.backend.forward_hidden(model, batch), batch,
                                    out=self._logits[: batch.batch_size])

    def finish(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        return output if output.shape[0] == bs else output[:bs]  # slicing costs host time

    def fill_buffers(self, batch: ForwardBatch | None, shape: int) -> ForwardBatch:
        live = batch.batch_size if batch is not None else 0
        dsts, pad_srcs = self._copy_targets(live, shape)
        srcs = [getattr(batch, name) for name in _FIELDS] if batch is not None else []
        copy_all(dsts, srcs + pad_srcs)
        seq_cpu = (batch.seq_lens_cpu if batch is not None else []) + [1] * (shape - live)
        padded = self._padded.get(shape)
        if padded is not None:  # its tensors are this shape's views of the buffers already
            padded.seq_lens_cpu = seq_cpu
            return padded
        return self.buffers.view(ForwardMode.DECODE, shape, shape, seq_cpu, [1] * shape,
                                 self.model_runner)

    def _copy_targets(self, live: int, shape: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the buffers' slices that `live` requests padded to `shape` fill: the live fields',
        then the padding's; the padding's sources), made once per (live, shape): slicing
        tensors is host time that every replay would pay."""
        key = (live, shape)
        if key not in self._targets:
            buf = self.buffers
            dsts = [getattr(buf, name)[:live] for name in _FIELDS] if live else []
            pad_srcs = []
            if live < shape:
                dsts += [getattr(buf, name)[live:shape] for name in _FIELDS]
                pad_srcs = [self._padding[name][: shape - live] for name in _FIELDS]
            self._targets[key] = (dsts, pad_srcs)
        return self._targets[key]
