"""Continuous-batching scheduler over one ModelRunner.

Each `step()` runs one forward pass: a prefill (EXTEND) batch when waiting requests can be
admitted, otherwise a decode batch of every running request. Prompts longer than
`chunked_prefill_size` are prefilled a chunk per step. With mixed chunks (`--enable-mixed-
chunk`) the running requests' decode tokens ride in the prefill step (first in the batch, within
the step's token budget), so a prefill does not stall their output. Admission is bounded by the
request table, `max_prefill_tokens` and free KV slots less a reserve for the tokens running
requests are still expected to generate (`new_token_ratio` x their remaining budget; the ratio
rises after each retraction and decays while decoding goes well). When decode still runs out of
KV slots the newest running requests are retracted to the front of the waiting queue (their KV
freed, their tokens recomputed when re-admitted). The step is the only place that builds
ForwardBatches (through `batch_ops`).

Overlap (the default; `--disable-overlap-schedule` turns it off): a step is launched before the
one before it is read back. A decode step's input tokens are those the step before sampled,
copied on the device, so the host builds the next batch, and then appends tokens, checks stops
and sends outputs, while the GPU runs: the GPU does not wait for the host between steps. A
request that finished in the step being read back was computed once more in the step in flight;
that token is dropped (a request that reaches `max_new_tokens` is left out of the next step,
since its end is known). A prefill step reads the step in flight back while the GPU runs the
prefill; its first tokens are then in flight. Retraction and an empty running set read the step
in flight back first, so they see every request's tokens.

Structured output: a request with a grammar (`Req.grammar`) has its logits row masked to the
tokens the grammar allows next, and finishes when the grammar has accepted a stop token. The mask
of a decode step depends on the token of the step before it, so under overlap the step is
launched first and the step in flight's tokens are then fed to the grammars (waiting for their
host copy only, which is ready long before the new step's forward ends): the host fills the
bitmask while the GPU runs the forward. A token fed there is not fed again when its step is
applied. A token the grammar rejects ends its request with an `abort` naming it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replaylm.layers.logit_adjust import LogitAdjuster, LogitAdjustments
from replaylm.layers.sampler import RankZeroSampler, Sampler, SamplingBatchInfo
from replaylm.mem_cache.errors import OutOfKVCacheError, OutOfRequestSlotsError
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.prefill_chunk import prefill_chunk
from replaylm.runtime.batch_ops import (
    prepare_decode,
    prepare_extend,
    prepare_verify,
    truncate_kv,
)
from replaylm.runtime.io_struct import SchedulerStats, TokenLogprob
from replaylm.runtime.prefix_cache import PrefixCache
from replaylm.runtime.prompt_logprobs import PromptLogprobPlan, prompt_token_logprobs
from replaylm.runtime.request import FinishReason, Req
from replaylm.speculative.drafter import Speculation, accept_matching
from replaylm.speculative.setup import speculation_from_args

if TYPE_CHECKING:
    from replaylm.server_args import ServerArgs
    from replaylm.structured.bitmask import GrammarMask

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per decode step
RETRACT_RATIO_BUMP = 0.25
LPM_MAX_WAITING = 128  # waiting requests up to which admission orders them by cached prefix
IN_BATCH_SHARED_MIN = 32  # tokens a batch-mate must share beyond the cache to defer a request


@dataclass
class StepOutput:
    """What one step did to one request: tokens appended (0 or 1) and whether it finished;
    with its first token, its prompt logprobs when it asked for them."""

    req: Req
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class _Logprobs:
    """Log-probabilities of one step's sampled tokens for the requests that asked for them:
    `wanted` (their rows), each chosen token's logprob and the top `k` (ids, logprobs)."""

    wanted: list[int]
    chosen: torch.Tensor  # [W] float32
    top_vals: torch.Tensor  # [W, k] float32
    top_ids: torch.Tensor  # [W, k] int64

    def to_host(self) -> _Logprobs:
        return _Logprobs(
            self.wanted, *(_to_host(t) for t in (self.chosen, self.top_vals, self.top_ids))
        )


@dataclass
class _Sampled:
    """A launched step's sampled tokens: `next_ids` on the device (the next decode step's input
    ids), their copies on the host (and the logprobs'), complete once `ready` has passed (None:
    computed on the host already). `rows` maps id(req) to its row."""

    reqs: list[Req]
    next_ids: torch.Tensor
    host_ids: torch.Tensor
    logprobs: _Logprobs | None
    ready: torch.cuda.Event | None
    rows: dict[int, int]
    _tokens: list[int] | None = None

    @classmethod
    def start(cls, reqs: list[Req], next_ids: torch.Tensor, logprobs: _Logprobs | None) -> _Sampled:
        """Start the copies to the host behind the step's work on the current stream."""
        host_ids = _to_host(next_ids)
        host_logprobs = logprobs.to_host() if logprobs is not None else None
        ready = None
        if next_ids.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return cls(
            reqs, next_ids, host_ids, host_logprobs, ready, {id(r): i for i, r in enumerate(reqs)}
        )

    def tokens(self) -> list[int]:
        """The token per request, waiting for the copies only."""
        if self._tokens is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._tokens = self.host_ids.tolist()
        return self._tokens

    def results(self) -> tuple[list[int], list[list[TokenLogprob] | None] | None]:
        """(token per request, logprobs per request or None), waiting for the copies only."""
        tokens = self.tokens()
        return tokens, _token_logprobs(self.reqs, tokens, self.logprobs)


class Scheduler:
    """Owns the waiting queue and the running set; `decode_text` maps output ids to text (used
    for stop strings; None when the model has no tokenizer)."""

    def __init__(
        self,
        runner: ModelRunner,
        eos_ids: frozenset[int],
        decode_text: Callable[[list[int]], str] | None,
        chunked_prefill_size: int,
        max_prefill_tokens: int | None,
        overlap: bool = True,
        prefix_cache: bool = True,
        mixed_chunk: bool = False,
        speculation: Speculation | None = None,
    ) -> None:
        """`max_prefill_tokens` None: a prefill batch holds at most `chunked_prefill_size`.
        `overlap`: launch each decode step before reading the one before back. `prefix_cache`:
        keep computed tokens in a radix tree and start prompts from their cached prefixes.
        `mixed_chunk`: decode the running requests in prefill steps too, their tokens counted in
        the step's `max_prefill_tokens`. `speculation`: decode steps become verify steps of its
        drafter's tokens (the overlap schedule is then off: each step's drafts follow the
        tokens the step before accepted)."""
        self.runner = runner
        self.eos_ids = eos_ids
        self.decode_text = decode_text
        self.chunk_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens or chunked_prefill_size
        self.kv = runner.kv
        self.prefix_cache = PrefixCache(self.kv, prefix_cache)
        # sampling: the step's own, outside the model's forward (under tensor parallelism rank
        # 0's ids, broadcast); penalty state per request-table row, allocated when a penalised
        # request first comes
        self.sampler = Sampler() if runner.tp.size == 1 else RankZeroSampler()
        self.logit_adjuster = LogitAdjuster(
            self.kv.max_requests, runner.config.vocab_size, runner.device
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # requests with a full cached prompt, decoding
        self.num_retractions = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.min_new_token_ratio = MIN_NEW_TOKEN_RATIO
        self.speculation = speculation
        self.overlap = overlap and speculation is None
        self.mixed_chunk = mixed_chunk
        self._in_flight: _Sampled | None = None  # a decode step not read back yet
        self._grammar_mask: GrammarMask | None = None  # made for the first constrained batch
        self.grammar_steps = 0  # sampling steps with a constrained request
        self.grammar_host_s = 0.0  # host time spent feeding grammars and filling bitmasks
        logger.info(
            "overlap schedule: %s",
            "on (each decode step is launched before the one before it is read back)"
            if self.overlap
            else "off (speculative decoding: each step's drafts follow the step before)"
            if overlap
            else "off (--disable-overlap-schedule)",
        )
        logger.info(
            "mixed chunks: %s",
            "on (running requests decode in prefill steps)"
            if mixed_chunk
            else "off (a prefill step pauses decoding; --enable-mixed-chunk mixes them)",
        )

    @classmethod
    def from_args(
        cls,
        runner: ModelRunner,
        eos_ids: frozenset[int],
        decode_text: Callable[[list[int]], str] | None,
        args: ServerArgs,
        draft: ModelRunner | None = None,
        offline: bool = False,
    ) -> Scheduler:
        """The scheduler the server's flags describe (`draft`: the draft model's or EAGLE
        head's runner, for speculation with one; `offline`: the offline Engine's)."""
        chunk, why = prefill_chunk(args.chunked_prefill_size, runner.model, offline)
        logger.info("prefill chunks: up to %d tokens a step (%s)", chunk, why)
        return cls(
            runner,
            eos_ids,
            decode_text,
            chunk,
            args.max_prefill_tokens,
            overlap=not args.disable_overlap_schedule,
            prefix_cache=not args.disable_radix_cache,
            mixed_chunk=args.enable_mixed_chunk,
            speculation=speculation_from_args(args, runner, draft, chunk),
        )

    # ---- requests in and out ------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request. Its prompt plus one token must fit the KV cache (callers clamp)."""
        if len(req.input_ids) >= self.kv.size:
            raise ValueError(
                f"the prompt has {len(req.input_ids)} tokens; the KV cache holds {self.kv.size}"
            )
        self.waiting.append(req)

    def abort(self, rid: object) -> Req | None:
        """Remove a request wherever it is, free its KV at once; returns it (None if unknown).
        A choice not forked yet is dropped from its parent; the pending choices of an aborted
        parent go on as requests of their own."""
        for queue in (self.running, self.waiting):
            for req in queue:
                for i, (fork_rid, seed) in enumerate(req.forks):
                    if fork_rid == rid:
                        del req.forks[i]
                        child = req.fork(fork_rid, seed)
                        child.finish_reason = FinishReason("abort", "aborted by the client")
                        return child
                if req.rid == rid:
                    queue.remove(req)
                    self._release(req)
                    req.finish_reason = FinishReason("abort", "aborted by the client")
                    self.waiting.extendleft(reversed(self._unforked(req)))
                    return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    def stats(self) -> SchedulerStats:
        total = self.kv.size
        experts = self.runner.expert_tokens  # a mixture of experts' counters, read now and then
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_used_tokens=total - self.prefix_cache.available,
            kv_total_tokens=total,
            num_retractions=self.num_retractions,
            forward_stats=self.runner.forward_stats,
            grammar_steps=self.grammar_steps,
            grammar_host_s=self.grammar_host_s,
            prefix_prompt_tokens=self.prefix_cache.prompt_tokens,
            prefix_cached_tokens=self.prefix_cache.cached_tokens,
            prefix_cache_tokens=self.prefix_cache.tree.total_size
            if self.prefix_cache.tree is not None
            else 0,
            speculation=self.speculation.stats if self.speculation is not None else None,
            expert_tokens=experts.read() if experts is not None else None,
        )

    def run_to_completion(self) -> None:
        """Step until every queued request has finished (the offline Engine's loop)."""
        while self.has_work:
            self.step()

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one forward pass; return the requests that got a token (finished ones included).
        With overlap, a step returns the tokens of the step before it."""
        admitted = self._admit_prefill()
        if admitted:
            return self._prefill_step(*admitted)
        outputs = []
        if self.prefix_cache.available < len(self.running):
            outputs = self._read_back()  # its finished requests free slots; retract after
        if not self.running:
            return outputs + self._read_back()
        self._decay_new_token_ratio()
        self._retract_for_decode()
        if self._speculating():
            return outputs + self._read_back() + self._verify_step()
        launched = self._launch_decode()
        outputs += self._read_back()
        self._in_flight = launched
        if not self.overlap:
            outputs += self._read_back()
        return outputs

    def _prefill_step(
        self, reqs: list[Req], chunks: list[int], riders: list[Req]
    ) -> list[StepOutput]:
        """Prefill the admitted chunks, with one decode token of each rider (a mixed step, whose
        sampled tokens are read back as a decode step's are); the requests whose prompt is now
        cached sample their first token."""
        plan = PromptLogprobPlan.build(reqs, chunks, first_token=len(riders))
        self.prefix_cache.make_room(sum(chunks) + len(riders))
        batch = prepare_extend(reqs, self.runner, chunks, decoding=riders)
        pending = self._feed_in_flight(riders, batch.input_ids)
        if plan is None:
            logits = self.runner.forward(batch)
        else:
            index = torch.tensor(plan.token_index).to(batch.input_ids.device, non_blocking=True)
            logits, hidden = self.runner.forward_keeping_hidden(batch, index)
            plan.score(self.runner, hidden)
        for req in reqs:
            self.prefix_cache.cache_computed(req)
        outputs = [] if riders else self._read_back()  # while the GPU runs the prefill
        done = [i for i, r in enumerate(reqs) if r.kv_len == r.num_ids]
        for i, req in enumerate(reqs):
            if i in done:
                self.running.append(req)
            else:
                self.waiting.appendleft(req)  # a chunked prompt: next chunk next step
        sample_reqs, rows = self._fork_choices([reqs[i] for i in done])
        # their first sample: penalty state from their prompt (and output, if re-admitted)
        self.logit_adjuster.init_requests(sample_reqs)
        # logits rows: the riders', then the prefilled requests' (forked choices share a row)
        rows = list(range(len(riders))) + [len(riders) + done[row] for row in rows]
        if not rows:
            return outputs
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(rows).to(logits.device, non_blocking=True))
        sampled = self._sample(riders + sample_reqs, logits, pending)
        if riders:
            self._decay_new_token_ratio()
        outputs += self._read_back()  # the riders' step (a prefill alone read it back above)
        self._in_flight = sampled
        if not self.overlap:
            outputs += self._read_back()
        return outputs

    def _feed_in_flight(self, reqs: list[Req], input_ids: torch.Tensor) -> dict[int, int]:
        """Copy the step in flight's tokens into the inputs of those of `reqs` (the batch's first
        tokens: a decode batch's, or a mixed step's riders) it computed, on the device; the
        in-flight rows by id(req), as `_sample` takes them."""
        in_flight = self._in_flight
        if in_flight is None or not reqs:
            return {}
        pending = in_flight.rows
        at = [i for i, r in enumerate(reqs) if id(r) in pending]
        rows = [pending[id(reqs[i])] for i in at]
        if at == rows:  # the usual case: a decode step after a decode step, in the same order
            input_ids[: len(at)].copy_(in_flight.next_ids[: len(at)])
        elif at:
            device = input_ids.device
            index = torch.tensor(at).to(device, non_blocking=True)
            ids = in_flight.next_ids[torch.tensor(rows).to(device, non_blocking=True)]
            input_ids.index_copy_(0, index, ids)
        return pending

    def _decay_new_token_ratio(self) -> None:
        """Decoding went well for a step: expect a little less of the running requests' budget."""
        self.new_token_ratio = max(
            self.min_new_token_ratio, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )

    def _decoding(self) -> list[Req]:
        """The running requests a decode step computes: all but those whose token in flight is
        their last (their end is known)."""
        in_flight = self._in_flight
        pending = in_flight.rows if in_flight is not None else {}
        return [
            r
            for r in self.running
            if id(r) not in pending or len(r.output_ids) + 1 < r.max_new_tokens
        ]

    def _launch_decode(self) -> _Sampled | None:
        """Launch a decode step of the running requests, its input tokens those of the step in
        flight where there is one (copied on the device); None when every request ends in it."""
        in_flight = self._in_flight
        pending = in_flight.rows if in_flight is not None else {}
        reqs = self._decoding()
        if not reqs:
            return None
        self.prefix_cache.make_room(len(reqs))
        batch = prepare_decode(reqs, self.runner)
        self._feed_in_flight(reqs, batch.input_ids)
        logits = self.runner.forward(batch)
        return self._sample(reqs, logits, pending)

    def _read_back(self) -> list[StepOutput]:
        """Apply the step in flight's tokens (nothing when none is)."""
        in_flight, self._in_flight = self._in_flight, None
        return self._apply(in_flight) if in_flight is not None else []

    def _fork_choices(self, prefilled: list[Req]) -> tuple[list[Req], list[int]]:
        """Fork the other choices of the `n > 1` requests just prefilled. Returns the requests
        to sample and, for each, the index in `prefilled` whose logits it samples from. Choices
        that cannot get KV now are queued as requests of their own (they prefill alone)."""
        reqs, rows = list(prefilled), list(range(len(prefilled)))
        for row, parent in enumerate(prefilled):
            children = self._unforked(parent)
            if not children:
                continue
            try:
                self.prefix_cache.fork(parent, children)
            except (OutOfKVCacheError, OutOfRequestSlotsError) as err:
                logger.info("request %s: %s; its other choices prefill alone", parent.rid, err)
                self.waiting.extendleft(reversed(children))
                continue
            self.running += children
            reqs += children
            rows += [row] * len(children)
        return reqs, rows

    @staticmethod
    def _unforked(req: Req) -> list[Req]:
        """Take the request's pending choices off it, as requests."""
        children = [req.fork(rid, seed) for rid, seed in req.forks]
        req.forks = []
        return children

    def _expected_new_tokens(self, req: Req) -> int:
        return int((req.max_new_tokens - len(req.output_ids)) * self.new_token_ratio)

    def _admit_prefill(self) -> tuple[list[Req], list[int], list[Req]] | None:
        """Pick waiting requests and their chunk sizes for one EXTEND batch, and its riders (the
        running requests to decode in it, with mixed chunks: they take their tokens out of the
        step's budget): in queue order, or longest cached prefix first while the queue is short
        (see `_order_waiting`). A request whose prefix another request of this batch is
        computing waits for the next batch, which finds it cached."""
        if not self.waiting:
            return None  # before the reserve: a decode step's host time counts
        reserved = sum(self._expected_new_tokens(r) for r in self.running)
        free_rows = self.kv.req_to_token.available_size()
        if (free_rows == 0 and self.waiting[0].req_pool_idx is None) or (
            self.prefix_cache.available - len(self.running) - reserved <= 1
        ):
            return None  # nothing is admissible: skip ordering and matching the queue
        self._order_waiting()
        riders = self._decoding() if self.mixed_chunk else []
        if len(riders) >= self.max_prefill_tokens:
            riders = []  # no room for a prefill token beside them: this step prefills alone
        budget = self.max_prefill_tokens - len(riders)
        reqs: list[Req] = []
        chunks: list[int] = []
        deferred: list[Req] = []
        used = 0  # KV slots this batch takes (its chunks and their first decode tokens)
        while self.waiting:
            req = self.waiting[0]
            found = self.prefix_cache.match(req)
            if found is not None and reqs and _computing_more(reqs, req, len(found.slots)):
                deferred.append(self.waiting.popleft())
                continue
            cached = len(found.slots) if found is not None else 0
            # locking the match takes its slots out of what eviction can free
            locked = self.prefix_cache.lock_cost(found)
            free_kv = self.prefix_cache.available - locked - len(self.running) - reserved - used
            todo = req.num_ids - req.kv_len - cached
            needs_row = req.req_pool_idx is None
            # keep one slot per admitted request for its first decode token
            # the first chunk may exceed the budget (a step always admits one), unless riders
            # share the step: then the batch must still fit the largest prefill graph
            chunk = min(todo, self.chunk_size, budget if reqs or riders else todo, free_kv - 1)
            if chunk <= 0 or (needs_row and free_rows == 0):
                break
            alone = not self.running and not reqs  # always admissible: callers clamp budgets
            # the choices forked once the prompt is cached each need a row, and their KV unless
            # the prefix cache shares the prompt
            forks = len(req.forks) if chunk == todo else 0
            prompt_copy = 0 if self.prefix_cache.tree is not None else req.num_ids
            fork_kv = forks * (prompt_copy + 1 + self._expected_new_tokens(req))
            if (
                chunk == todo
                and not alone
                and (
                    todo + 1 + self._expected_new_tokens(req) + fork_kv > free_kv
                    or needs_row + forks > free_rows
                )
            ):
                break  # would finish its prompt with no room to decode: wait
            self.waiting.popleft()
            self.prefix_cache.admit(req, found)
            if req.admitted_at is None:  # not for a later chunk or after a retraction
                req.admitted_at = time.time()
            reqs.append(req)
            chunks.append(chunk)
            used += chunk + 1 + fork_kv  # + its first decode token
            free_rows -= needs_row + forks
            budget -= chunk
            if chunk < todo:
                break  # one chunked prompt per batch, last
        self.waiting.extendleft(reversed(deferred))
        if not reqs:
            return None
        logger.info(
            "prefill batch: %d requests, %d new tokens, %d cached tokens, %d decoding alongside; "
            "%d running, %d waiting",
            len(reqs),
            sum(chunks),
            sum(r.kv_len for r in reqs),  # before this batch: what earlier steps or the cache hold
            len(riders),
            len(self.running),
            len(self.waiting),
        )
        return reqs, chunks, riders

    def _order_waiting(self) -> None:
        """Longest cached prefix first while at most LPM_MAX_WAITING requests wait (SGLang's
        policy: reuse what is cached before it is evicted); first come first served beyond that,
        where matching every request each step costs more than it saves. A partly prefilled
        prompt stays first (it holds KV and a row)."""
        if self.prefix_cache.tree is None or not 1 < len(self.waiting) <= LPM_MAX_WAITING:
            return
        started = [r for r in self.waiting if r.kv_slots]
        rest = [r for r in self.waiting if not r.kv_slots]
        matched = {
            id(r): len(m.slots) if (m := self.prefix_cache.match(r)) is not None else 0
            for r in rest
        }
        rest.sort(key=lambda r: -matched[id(r)])  # stable: ties keep their arrival order
        self.waiting = deque(started + rest)

    def _retract_for_decode(self) -> None:
        """Free KV for one decode token per running request: move the newest running requests
        back to the waiting queue, then (if one request still cannot step) drop the cached
        chunks of partially prefilled waiting requests. Retracted tokens are recomputed later."""
        while self.prefix_cache.available < len(self.running) and len(self.running) > 1:
            req = self.running.pop()
            self._retract(req)
            self.waiting.appendleft(req)
        if self.prefix_cache.available < len(self.running):
            for req in self.waiting:
                if req.kv_len:
                    self._retract(req)

    def _retract(self, req: Req) -> None:
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_BUMP)
        logger.info(
            "KV cache full: retracted request %s (%d cached tokens to recompute)",
            req.rid,
            req.kv_len,
        )
        self._release(req)
        self.num_retractions += 1

    def _sample(
        self,
        reqs: list[Req],
        logits: torch.Tensor,
        pending: dict[int, int] | None = None,
        ahead: list[int] | None = None,
    ) -> _Sampled:
        """Sample each row's next token on the device (row i: request `reqs[i]`). `pending`:
        requests (by id) with a token in flight, which counts as generated (each sampling step
        has its own noise); `ahead[i]`: tokens row i is past the request's output (a verify
        step's rows after the first, each sampled with its own step's noise)."""
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            [r.seed for r in reqs],
            logits.shape[-1],
            logits.device,
        )
        pending = pending or {}
        num_out = [len(r.output_ids) + (id(r) in pending) for r in reqs]
        if ahead is not None:
            num_out = [n + a for n, a in zip(num_out, ahead, strict=True)]
        steps = torch.tensor(num_out).to(logits.device, non_blocking=True)
        adjust = self.logit_adjuster.adjustments(reqs, num_out, self.eos_ids)
        next_ids = self.draw_tokens(self._constrain(reqs, logits), info, steps, adjust)
        return _Sampled.start(reqs, next_ids, _logprobs(reqs, logits, next_ids))

    @torch.inference_mode()
    def draw_tokens(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        steps: torch.Tensor,
        adjust: LogitAdjustments | None = None,
    ) -> torch.Tensor:
        """Next token id per request (`[B]` int64); `steps` = tokens each request generated.
        `adjust` (penalties, logit_bias, min_tokens) changes the logits the sampler sees, not
        `logits` itself (logprobs stay the model's), and counts the sampled ids for the
        penalties."""
        if adjust is None:
            return self.sampler(logits, info, steps)
        next_ids = self.sampler(adjust.apply(logits), info, steps)
        adjust.record(next_ids)
        return next_ids

    def _constrain(self, reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the rows of requests with a grammar masked to what it allows next (a
        copy; `logits` itself when no request has one; logprobs stay the model's). The step in
        flight's tokens, not applied yet, are fed to the grammars first."""
        grammars = {i: r.grammar for i, r in enumerate(reqs) if r.grammar is not None}
        if not grammars:
            return logits
        in_flight = self._in_flight
        pending = in_flight.rows if in_flight is not None else {}
        fed = [i for i in grammars if id(reqs[i]) in pending]
        # waits for the step in flight's host copy (no grammar work: outside the timing)
        tokens = in_flight.tokens() if in_flight is not None and fed else []
        start = time.perf_counter()
        for i in fed:
            grammars[i].feed(len(reqs[i].output_ids), tokens[pending[id(reqs[i])]])
        live = [i for i, g in grammars.items() if not g.done]
        if live:
            if self._grammar_mask is None:
                from replaylm.structured.bitmask import GrammarMask

                self._grammar_mask = GrammarMask()
            logits = self._grammar_mask.apply(logits, live, [grammars[i] for i in live])
        self.grammar_steps += 1
        self.grammar_host_s += time.perf_counter() - start
        return logits

    def _apply(self, sampled: _Sampled) -> list[StepOutput]:
        """Append the sampled tokens (skipping requests that finished or were aborted since the
        step was launched), release finished requests."""
        tokens, logprobs = sampled.results()
        return self._append(sampled.reqs, [[t] for t in tokens], logprobs)

    def _append(
        self,
        reqs: list[Req],
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprob] | None] | None,
    ) -> list[StepOutput]:
        """Append each request's tokens in order, up to the one that finishes it (the rest are
        dropped); release finished requests."""
        outputs = []
        for i, (req, new) in enumerate(zip(reqs, tokens, strict=True)):
            if req.finished:
                continue
            appended = []
            for token in new:
                if req.grammar is not None and not self._feed_grammar(req, token):
                    break
                text = None
                if req.sampling_params.stop and self.decode_text is not None:
                    text = self.decode_text([*req.output_ids, token])
                req.append_token(token, self.eos_ids, text)
                appended.append(token)
                if not req.finished and req.grammar is not None and req.grammar.terminated:
                    req.finish_reason = FinishReason("stop", token)  # a stop token, ignore_eos
                if req.finished:
                    break
            prompt_logprobs = None
            if req.prompt_logprobs is not None and len(req.output_ids) == len(appended) > 0:
                prompt_logprobs = prompt_token_logprobs(req)
            token_logprobs = logprobs[i] if logprobs and appended else None
            outputs.append(StepOutput(req, appended, token_logprobs, prompt_logprobs))
            if req.finished:
                self.running.remove(req)
                self._release(req)
        return outputs

    def _release(self, req: Req) -> None:
        """Give back what a request leaving the running set holds: its KV (the prefix cache
        keeps its tokens) and the drafter's state for it."""
        self.prefix_cache.release(req)
        if self.speculation is not None:
            self.speculation.drafter.release(req)

    # ---- speculative decoding -----------------------------------------------------------

    def _speculating(self) -> bool:
        spec = self.speculation
        return spec is not None and (spec.max_bs is None or len(self.running) <= spec.max_bs)

    def _drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's draft tokens: none for those that do not speculate, at most what its
        token budget and context leave after the target's own next token, and no more in all
        than the free KV beyond one slot per request."""
        assert self.speculation is not None
        k, context = self.speculation.num_steps, self.kv.req_to_token.row_width
        limits = [
            min(k, r.max_new_tokens - len(r.output_ids) - 1, context - r.kv_len - 2)
            if r.can_speculate
            else 0
            for r in reqs
        ]
        drafter = self.speculation.drafter
        drafts = drafter.propose(reqs, limits)
        if self.runner.tp.size > 1 and not drafter.same_on_every_rank:
            from replaylm.distributed.communication import broadcast_objects

            drafts = broadcast_objects([drafts] if self.runner.tp.rank == 0 else None)[0]
        room = self.prefix_cache.available - len(reqs)
        for i, d in enumerate(drafts):
            drafts[i] = d[: max(0, min(len(d), limits[i], room))]
            room -= len(drafts[i])
        return drafts

    def _verify_step(self) -> list[StepOutput]:
        """One verify step of every running request: its last token and drafts through the
        target at once; the drafts the target agrees with and the target's next token are
        appended, the rejected drafts' KV given back. Requests without drafts get one token, as
        in a decode step.

        Agreeing means: the draft is the token the request's own sampling (greedy, or its
        seeded draw at that output index) picks from the target's logits there. Each kept token
        is then the one plain decoding would have produced, so the output is plain decoding's,
        sampled requests' included; for a drafter proposing single tokens this is rejection
        sampling (a draft is kept with the target's probability of it)."""
        assert self.speculation is not None
        stats = self.speculation.stats
        reqs = list(self.running)
        began = time.perf_counter()
        drafts = self._drafts(reqs)
        drafted = time.perf_counter()
        self.prefix_cache.make_room(len(reqs) + sum(len(d) for d in drafts))
        batch = prepare_verify(reqs, drafts, self.runner)
        logits = self.runner.forward(batch)  # [T, V]: every token's next-token logits
        # every row sampled as plain decoding would sample it at that output index (the same
        # seeded noise): a draft is kept when it is the token drawn there
        rows = [r for r, d in zip(reqs, drafts, strict=True) for _ in range(len(d) + 1)]
        ahead = [i for d in drafts for i in range(len(d) + 1)]
        tokens, logprobs = self._sample(rows, logits, ahead=ahead).results()
        new_tokens = []
        start = 0
        for req, d in zip(reqs, drafts, strict=True):
            req.spec_verify_ct += 1
            chosen = tokens[start : start + len(d) + 1]
            accepted = accept_matching(d, chosen)
            if d:
                truncate_kv(req, req.kv_len - len(d) + accepted, self.kv)
                stats.record(len(d), accepted)
                req.spec_accepted += accepted
            new_tokens.append(chosen[: accepted + 1])
            start += len(d) + 1
        if logprobs is not None:  # only requests without drafts ask: one row each
            firsts = [i for i, a in enumerate(ahead) if a == 0]
            logprobs = [logprobs[i] for i in firsts]
        self.speculation.drafter.accepted(reqs, [len(t) - 1 for t in new_tokens])
        stats.verify_steps += 1
        stats.draft_seconds += drafted - began
        stats.verify_seconds += time.perf_counter() - drafted
        return self._append(reqs, new_tokens, logprobs)

    def _feed_grammar(self, req: Req, token: int) -> bool:
        """Feed the request's next token to its grammar (unless the overlap schedule did);
        False, with the request finished, when the grammar rejects it (never emitted)."""
        assert req.grammar is not None
        start = time.perf_counter()
        req.grammar.feed(len(req.output_ids), token)
        self.grammar_host_s += time.perf_counter() - start
        if req.grammar.rejected is None:
            return True
        req.finish_reason = FinishReason(
            "abort", f"the grammar engine rejected token {token}: the output cannot go on"
        )
        return False


def _computing_more(batch: list[Req], req: Req, cached: int) -> bool:
    """Whether a request of `batch` shares at least IN_BATCH_SHARED_MIN more prompt tokens with
    `req` than the cache holds: admitted together, both would compute them. The window past the
    cached prefix is compared first: it differs for most pairs, the prefix is long."""
    end = cached + IN_BATCH_SHARED_MIN
    if req.num_ids < end:
        return False
    window = req.id_slice(cached, end)
    prefix: list[int] | None = None
    for other in batch:
        if other.num_ids < end or other.id_slice(cached, end) != window:
            continue
        prefix = prefix if prefix is not None else req.id_slice(0, cached)
        if other.id_slice(0, cached) == prefix:
            return True
    return False


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`, asynchronous from CUDA (into pinned memory); `t` itself on the CPU."""
    return t.to("cpu", non_blocking=True)


def _logprobs(reqs: list[Req], logits: torch.Tensor, next_ids: torch.Tensor) -> _Logprobs | None:
    """Log-probabilities (of the model's distribution) for the requests that asked for them,
    on the device."""
    top_k = {i: r.top_logprobs for i, r in enumerate(reqs) if r.top_logprobs is not None}
    if not top_k:
        return None
    wanted = list(top_k)
    index = torch.tensor(wanted).to(logits.device, non_blocking=True)  # no wait for the stream
    rows = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = rows.gather(-1, next_ids.index_select(0, index)[:, None].long())[:, 0]
    k = max(top_k.values())
    top_vals, top_ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
    return _Logprobs(wanted, chosen, top_vals, top_ids)


def _token_logprobs(
    reqs: list[Req], tokens: list[int], logprobs: _Logprobs | None
) -> list[list[TokenLogprob] | None] | None:
    """Per request: its token's TokenLogprob (None for requests that did not ask)."""
    if logprobs is None:
        return None
    chosen = logprobs.chosen.tolist()
    top_vals, top_ids = logprobs.top_vals.tolist(), logprobs.top_ids.tolist()
    result: list[list[TokenLogprob] | None] = [None] * len(reqs)
    for row, i in enumerate(logprobs.wanted):
        n = reqs[i].top_logprobs
        top = list(zip(top_ids[row][:n], top_vals[row][:n], strict=True))
        result[i] = [TokenLogprob(tokens[i], chosen[row], top)]
    return result
