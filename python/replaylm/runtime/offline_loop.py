"""The offline generation loop used by Engine: prefill a wave of requests, decode it to the end.

Waves are sized so that every admitted request's whole budget (prompt + max_new_tokens) fits in
the KV cache, so decoding never runs out of slots. The serving scheduler replaces this loop with
continuous batching; both build batches only through `batch_ops`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from replaylm.layers.sampler import SamplingBatchInfo
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req


class OfflineGenerationLoop:
    """Runs requests to completion. `decode_text` maps token ids to text (for stop strings)."""

    def __init__(
        self, runner: ModelRunner, eos_ids: frozenset[int],
        decode_text: Callable[[list[int]], str] | None,
    ) -> None:
        self.runner = runner
        self.eos_ids = eos_ids
        self.decode_text = decode_text

    def run(self, reqs: list[Req]) -> None:
        pending = list(reqs)
        while pending:
            wave = self._admit(pending)
            pending = pending[len(wave) :]
            self._run_wave(wave)

    def _admit(self, pending: list[Req]) -> list[Req]:
        free_tokens = self.runner.token_allocator.available_size()
        free_rows = self.runner.req_to_token_pool.available_size()
        wave, used = [], 0
        for req in pending:
            need = len(req.input_ids) + req.max_new_tokens
            if len(wave) == free_rows or used + need > free_tokens:
                break
            wave.append(req)
            used += need
        if not wave:
            first = pending[0]
            raise ValueError(
                f"request needs {len(first.input_ids) + first.max_new_tokens} KV slots "
                f"(prompt + max_new_tokens) but the cache holds {free_tokens}; "
                "raise --max-total-tokens or lower max_new_tokens"
            )
        return wave

    def _run_wave(self, wave: list[Req]) -> None:
        running = wave
        batch = prepare_extend(running, self.runner)
        while True:
            logits = self.runner.forward(batch)
            self._sample_and_append(running, logits)
            for req in running:
                if req.finished:
                    release(req, self.runner)
            running = [r for r in running if not r.finished]
            if not running:
                return
            batch = prepare_decode(running, self.runner)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], [r.seed for r in reqs], logits.shape[-1],
            logits.device,
        )
        steps = torch.tensor([len(r.output_ids) for r in reqs], device=logits.device)
        next_ids = self.runner.sample(logits, info, steps).tolist()
        for req, token in zip(reqs, next_ids, strict=True):
            text = None
            if req.sampling_params.stop and self.decode_text is not None:
                text = self.decode_text([*req.output_ids, token])
            req.append_token(token, self.eos_ids, text)
