"""Continuous-batching scheduler over one ModelRunner.

Each `step()` runs one forward pass: a prefill (EXTEND) batch when waiting requests can be
admitted, otherwise a decode batch of every running request. Prompts longer than
`chunked_prefill_size` are prefilled a chunk per step. Admission is bounded by the request table,
`max_prefill_tokens` and free KV slots less a reserve for the tokens running requests are still
expected to generate (`new_token_ratio` x their remaining budget; the ratio rises after each
retraction and decays while decoding goes well). When decode still runs out of KV slots the
newest running requests are retracted to the front of the waiting queue (their KV freed, their
tokens recomputed when re-admitted). The step is the only place that builds ForwardBatches
(through `batch_ops`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from replaylm.layers.sampler import SamplingBatchInfo
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.io_struct import SchedulerStats, TokenLogprob
from replaylm.runtime.request import FinishReason, Req

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per decode step
RETRACT_RATIO_BUMP = 0.25


@dataclass
class StepOutput:
    """What one step did to one request: tokens appended (0 or 1) and whether it finished."""

    req: Req
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None


class Scheduler:
    """Owns the waiting queue and the running set; `decode_text` maps output ids to text (used
    for stop strings; None when the model has no tokenizer)."""

    def __init__(
        self, runner: ModelRunner, eos_ids: frozenset[int],
        decode_text: Callable[[list[int]], str] | None,
        chunked_prefill_size: int, max_prefill_tokens: int | None,
    ) -> None:
        """`max_prefill_tokens` None: a prefill batch holds at most `chunked_prefill_size`."""
        self.runner = runner
        self.eos_ids = eos_ids
        self.decode_text = decode_text
        self.chunk_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens or chunked_prefill_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # requests with a full cached prompt, decoding
        self.num_retractions = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.min_new_token_ratio = MIN_NEW_TOKEN_RATIO

    # ---- requests in and out ------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request. Its prompt plus one token must fit the KV cache (callers clamp)."""
        if len(req.input_ids) >= self.runner.max_total_tokens:
            raise ValueError(
                f"the prompt has {len(req.input_ids)} tokens; the KV cache holds "
                f"{self.runner.max_total_tokens}"
            )
        self.waiting.append(req)

    def abort(self, rid: object) -> Req | None:
        """Remove a request wherever it is, free its KV at once; returns it (None if unknown)."""
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    release(req, self.runner)
                    req.finish_reason = FinishReason("abort", "aborted by the client")
                    return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        total = self.runner.max_total_tokens
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_used_tokens=total - self.runner.token_allocator.available_size(),
            kv_total_tokens=total, num_retractions=self.num_retractions,
            forward_stats=self.runner.forward_stats,
        )

    def run_to_completion(self) -> None:
        """Step until every queued request has finished (the offline Engine's loop)."""
        while self.has_work:
            self.step()

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one forward pass; return the requests that got a token (finished ones included)."""
        prefill = self._admit_prefill()
        if prefill:
            reqs, chunks = prefill
            logits = self.runner.forward(prepare_extend(reqs, self.runner, chunks))
            done = [i for i, r in enumerate(reqs) if r.kv_len == r.num_ids]
            for i, req in enumerate(reqs):
                if i in done:
                    self.running.append(req)
                else:
                    self.waiting.appendleft(req)  # a chunked prompt: next chunk next step
            return self._sample([reqs[i] for i in done], logits[done])
        if not self.running:
            return []
        self.new_token_ratio = max(self.min_new_token_ratio,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self._retract_for_decode()
        logits = self.runner.forward(prepare_decode(self.running, self.runner))
        return self._sample(list(self.running), logits)

    def _expected_new_tokens(self, req: Req) -> int:
        return int((req.max_new_tokens - len(req.output_ids)) * self.new_token_ratio)

    def _admit_prefill(self) -> tuple[list[Req], list[int]] | None:
        """Pick waiting requests (FIFO) and their chunk sizes for one EXTEND batch."""
        reserved = sum(self._expected_new_tokens(r) for r in self.running)
        free_kv = self.runner.token_allocator.available_size() - len(self.running) - reserved
        free_rows = self.runner.req_to_token_pool.available_size()
        budget = self.max_prefill_tokens
        reqs, chunks = [], []
        while self.waiting:
            req = self.waiting[0]
            todo = req.num_ids - req.kv_len
            needs_row = req.req_pool_idx is None
            # keep one slot per admitted request for its first decode token
            chunk = min(todo, self.chunk_size, budget if reqs else todo, free_kv - 1)
            if chunk <= 0 or (needs_row and free_rows == 0):
                break
            alone = not self.running and not reqs  # always admissible: callers clamp budgets
            if chunk == todo and not alone and (
                todo + 1 + self._expected_new_tokens(req) > free_kv
            ):
                break  # would finish its prompt with no room to decode: wait
            self.waiting.popleft()
            reqs.append(req)
            chunks.append(chunk)
            free_kv -= chunk + 1  # + its first decode token
            free_rows -= needs_row
            budget -= chunk
            if chunk < todo:
                break  # one chunked prompt per batch, last
        return (reqs, chunks) if reqs else None

    def _retract_for_decode(self) -> None:
        """Free KV for one decode token per running request: move the newest running requests
        back to the waiting queue, then (if one request still cannot step) drop the cached
        chunks of partially prefilled waiting requests. Retracted tokens are recomputed later."""
        allocator = self.runner.token_allocator
        while allocator.available_size() < len(self.running) and len(self.running) > 1:
            req = self.running.pop()
            self._retract(req)
            self.waiting.appendleft(req)
        if allocator.available_size() < len(self.running):
            for req in self.waiting:
                if req.kv_len:
                    self._retract(req)

    def _retract(self, req: Req) -> None:
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_BUMP)
        logger.info(
            "KV cache full: retracted request %s (%d cached tokens to recompute)",
            req.rid, req.kv_len,
        )
        release(req, self.runner)
        self.num_retractions += 1

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> list[StepOutput]:
        if not reqs:
            return []
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], [r.seed for r in reqs], logits.shape[-1],
            logits.device,
        )
        steps = torch.tensor([len(r.output_ids) for r in reqs], device=logits.device)
        next_ids = self.runner.sample(logits, info, steps)
        logprobs = _logprobs(reqs, logits, next_ids)
        outputs = []
        for i, (req, token) in enumerate(zip(reqs, next_ids.tolist(), strict=True)):
            text = None
            if req.sampling_params.stop and self.decode_text is not None:
                text = self.decode_text([*req.output_ids, token])
            req.append_token(token, self.eos_ids, text)
            outputs.append(StepOutput(req, [token], logprobs[i] if logprobs else None))
            if req.finished:
                self.running.remove(req)
                release(req, self.runner)
        return outputs


def _logprobs(
    reqs: list[Req], logits: torch.Tensor, next_ids: torch.Tensor
) -> list[list[TokenLogprob] | None] | None:
    """Log-probabilities (of the model's distribution) for requests that asked for them."""
    wanted = [i for i, r in enumerate(reqs) if r.top_logprobs is not None]
    if not wanted:
        return None
    rows = torch.log_softmax(logits[wanted].float(), dim=-1)
    chosen = rows.gather(-1, next_ids[wanted, None].long())[:, 0].tolist()
    k = max(reqs[i].top_logprobs for i in wanted)
    top_vals, top_ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
    result: list[list[TokenLogprob] | None] = [None] * len(reqs)
    for row, i in enumerate(wanted):
        n = reqs[i].top_logprobs
        top = list(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist(), strict=True))
        result[i] = [TokenLogprob(int(next_ids[i]), chosen[row], top)]
    return result
