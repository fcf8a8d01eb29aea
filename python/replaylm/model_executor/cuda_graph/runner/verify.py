"""Verify graphs: speculative decoding's TARGET_VERIFY steps, one graph per token bucket (a
decode batch size times the tokens each request verifies: its last token and its drafts)."""

from __future__ import annotations

from replaylm.model_executor.cuda_graph.runner.prefill import PrefillCudaGraphRunner
from replaylm.model_executor.forward_batch import ForwardMode


class VerifyCudaGraphRunner(PrefillCudaGraphRunner):
    """A prefill graph for verify batches only (the prefill runner never replays one, nor this
    one an EXTEND batch): the hidden states of the bucket's tokens are captured, and every
    token's logits computed after the replay, as the verify step checks each draft. A batch
    whose requests propose fewer drafts pads up to the next bucket."""

    phase = "verify"
    mode = ForwardMode.TARGET_VERIFY
    shape_unit, max_shape_flag = "tokens", "--speculative-max-bs"

    def shape_key(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> int | None:
        if not mode.is_verify() or batch_size > self.context.kv.max_requests:
            return None
        return num_tokens
