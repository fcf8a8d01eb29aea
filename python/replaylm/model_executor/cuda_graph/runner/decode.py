"""Decode graphs: one per batch size; each request feeds exactly one token."""

from __future__ import annotations

import torch

from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode
from replaylm.model_executor.packed_inputs import DecodeInputs

# the fields a batch built elsewhere has copied in (the others are the same for every decode
# batch of a shape: one new token per request, starting at its index)
_COPIED = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens")


class DecodeCudaGraphRunner(BaseCudaGraphRunner):
    """Shape key: the batch size. Each shape's graph reads its inputs from that shape's own
    `DecodeInputs`, where `prepare_decode` builds the batch (`inputs_for`), so a replay copies
    nothing; a batch built elsewhere is copied in. Padding requests sit at the end: seq_len 1
    over the padding row, writing their one token to KV slot 0."""

    phase = "decode"
    shape_unit, max_shape_flag = "requests", "--decode-cuda-graph-max-bs"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        runner = self.model_runner
        # every shape writes its logits here: one [max_bs, V] buffer instead of one per shape
        self._logits = torch.empty(
            self.max_batch_size,
            runner.config.vocab_size,
            dtype=torch.float32,
            device=runner.device,
        )
        self.inputs = {shape: DecodeInputs(shape, runner.device) for shape in self.shapes}
        # all padding: the values the copies of a batch built elsewhere are padded with
        self._padding = self._build_padding(DecodeInputs(self.max_batch_size, runner.device))
        for inputs in self.inputs.values():
            self._build_padding(inputs)
        self._targets: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def buffer_sizes(self) -> tuple[int, int]:
        return self.shapes[-1], self.shapes[-1]

    def shape_key(self, batch: ForwardBatch) -> int | None:
        return batch.batch_size if batch.forward_mode.is_decode() else None

    def inputs_for(self, batch_size: int) -> DecodeInputs | None:
        """Where a decode batch of `batch_size` requests is best built: the inputs of the shape
        that will replay it (None: no shape that large, or an empty batch)."""
        shape = self.shape_for(batch_size) if batch_size > 0 else None
        return self.inputs[shape] if shape is not None else None

    def forward_fn(self, batch: ForwardBatch) -> torch.Tensor:
        """The whole forward, logits included (the batch size is fixed per shape), written by the
        LM head straight into the logits buffer all shapes share."""
        model = self.model_runner.model
        return model.compute_logits(
            self.backend.forward_hidden(model, batch), batch, out=self._logits[: batch.batch_size]
        )

    def finish(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        return output if output.shape[0] == bs else output[:bs]  # slicing costs host time

    def fill_buffers(self, batch: ForwardBatch | None, shape: int) -> ForwardBatch:
        inputs = self.inputs[shape]
        live = batch.batch_size if batch is not None else 0
        if batch is None:
            self._build_padding(inputs)
        elif not inputs.holds(batch.input_ids):
            dsts, pad_srcs = self._copy_targets(live, shape)
            # one multi-tensor copy: one launch where the pairs share a dtype, not one per pair
            torch._foreach_copy_(
                dsts, [getattr(batch, name) for name in _COPIED] + pad_srcs, non_blocking=True
            )
        seq_cpu = (batch.seq_lens_cpu if batch is not None else []) + [1] * (shape - live)
        padded = self._padded.get(shape)
        if padded is not None:  # its tensors are this shape's inputs already
            padded.seq_lens_cpu = seq_cpu
            return padded
        runner = self.model_runner
        return ForwardBatch.from_fields(
            ForwardMode.DECODE,
            inputs.fields,
            seq_cpu,
            [1] * shape,
            runner.req_to_token_pool,
            runner.kv_pool,
            runner.attn_backend,
        )

    def _build_padding(self, inputs: DecodeInputs) -> DecodeInputs:
        """Fill `inputs` with padding requests only (ForwardBatch.create's padding)."""
        runner = self.model_runner
        ForwardBatch.create(
            ForwardMode.DECODE,
            [],
            [],
            [],
            [],
            runner.req_to_token_pool,
            runner.kv_pool,
            runner.attn_backend,
            into=inputs,
        )
        return inputs

    def _copy_targets(self, live: int, shape: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the slices of `shape`'s inputs that `live` requests padded to `shape` fill: the live
        fields', then the padding's; the padding's sources), made once per (live, shape):
        slicing tensors is host time that every replay would pay."""
        key = (live, shape)
        if key not in self._targets:
            inputs = self.inputs[shape]
            dsts = [inputs.field(name)[:live] for name in _COPIED] if live else []
            pad_srcs = []
            if live < shape:
                dsts += [inputs.field(name)[live:shape] for name in _COPIED]
                pad_srcs = [self._padding.field(name)[: shape - live] for name in _COPIED]
            self._targets[key] = (dsts, pad_srcs)
        return self._targets[key]
