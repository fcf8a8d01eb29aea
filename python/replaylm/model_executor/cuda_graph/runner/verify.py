"""Verify graphs: speculative decoding's TARGET_VERIFY steps, laid out as decode rows (one per
token: each request's last token and its drafts), so they replay as decode graphs do, under
every mode, one graph per row count (a decode batch size times the tokens a request verifies)."""

from __future__ import annotations

from replaylm.model_executor.cuda_graph.runner.decode import DecodeCudaGraphRunner
from replaylm.model_executor.forward_batch import ForwardMode


class VerifyCudaGraphRunner(DecodeCudaGraphRunner):
    """A decode graph runner for verify batches only (the decode runner never replays one, nor
    this one a DECODE batch): every row's logits come out of the graph, as the verify step
    checks each draft. A batch whose requests propose fewer drafts pads up to the next shape."""

    phase = "verify"
    mode = ForwardMode.TARGET_VERIFY
    shape_unit, max_shape_flag = "tokens", "--speculative-max-bs"

    def shape_key(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> int | None:
        return batch_size if mode.is_verify() else None
