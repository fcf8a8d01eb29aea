"""TokenizerManager: the main process's side of serving.

It starts the scheduler child process (or takes one already started), loads the tokenizer while
the child loads the model, and waits for the model; then it tokenizes and validates requests,
sends them to the scheduler, and turns the scheduler's per-step token outputs into text deltas
for the HTTP layer. A reader thread receives from the child; it hands each message to the event
loop, so all request state is touched on the loop's thread only. If the child dies, every pending
request fails with ServiceUnavailableError and `healthy()` turns False (the server then exits, see
launch_server). A child that fails to load the model raises SchedulerStartError (one line).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from replaylm.model_loader.tokenizer import (
    chat_input_ids,
    load_tokenizer,
    stream_step,
    token_decoder,
    tokenizer_info,
)
from replaylm.runtime.detokenizer import IncrementalDetokenizer
from replaylm.runtime.errors import RequestError, ServiceUnavailableError, one_line_error
from replaylm.runtime.io_struct import (
    MAX_TOP_LOGPROBS,
    AbortReq,
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    FrameSend,
    GenerateOutput,
    GenerateRequest,
    ReqTokenOut,
    SchedulerFailed,
    SchedulerReady,
    TextFrame,
    TokenizedGenerateReq,
    send_message,
)
from replaylm.runtime.metrics import ServerMetrics
from replaylm.runtime.request import FinishReason
from replaylm.runtime.request_limits import check_input_ids, check_vocab_ids, clamp_max_new_tokens
from replaylm.runtime.scheduler_process import (
    SchedulerLink,
    SchedulerProcess,
    SchedulerStartError,
)
from replaylm.sampling_params import SamplingParams
from replaylm.startup_stages import StartupStages
from replaylm.structured.cache import HeldGrammars

if TYPE_CHECKING:
    from replaylm.model_executor.engine_config import EngineConfig
    from replaylm.model_loader.tokenizer import HFTokenizer
    from replaylm.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


MAX_CHOICES = 128  # OpenAI's limit on `n`
STARTUP_POLL_S = 0.5  # how often the wait for the model checks the other ranks' processes
RANK_EXIT_GRACE_S = 2.0  # how long rank 0 gets to say why after another rank exited at start
_MAX_SEED = 2**63 - 1


class _Outbox:
    """A request's outputs, put by the message handler and taken all at once by the request's
    generator: a list and its waiter's future (an asyncio.Queue costs more per token)."""

    def __init__(self) -> None:
        self._items: list[GenerateOutput | bytes | Exception] = []
        self._waiter: asyncio.Future[None] | None = None
        self._sending: asyncio.Future[None] | None = None  # a frame's write, unfinished

    def put_frame(self, frame: bytes, send: FrameSend | None) -> None:
        """Put a rendered frame; or, with `send` while the consumer waits with everything
        before it sent (its waiter pending, no write unfinished), write it through `send` at
        once, waking no task."""
        waiter = self._waiter
        if send is None or waiter is None or waiter.done() or self._sending is not None:
            self.put(frame)
            return
        try:
            pending = send(frame)
        except Exception:  # the consumer's own write meets the same error, in its task
            self.put(frame)
            return
        if pending is not None:  # the connection's buffer is full: take() waits for the write
            self._sending = asyncio.ensure_future(pending)

    def put(self, item: GenerateOutput | bytes | Exception) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[GenerateOutput | bytes | Exception]:
        """Everything put since the last take, once there is something."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._sending is not None:  # a frame put before these is still being written
            sending, self._sending = self._sending, None
            await sending
        items, self._items = self._items, []
        return items


@dataclass
class _ReqState:
    """One choice in flight: the request's outbox (shared by its choices), the choice's
    index, detokenizer, frame renderer (None: every increment is a GenerateOutput) and timing
    for metrics."""

    outbox: _Outbox
    index: int
    detok: IncrementalDetokenizer | None
    prompt_tokens: int
    text_frame: TextFrame | None = None
    created: float = field(default_factory=time.perf_counter)
    created_wall: float = field(default_factory=time.time)  # against the scheduler's times
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    sent_chars: int = 0
    finished: bool = False
    last_full: ReqTokenOut | None = None  # the scheduler's last whole output for the choice


class TokenizerManager:
    """See the module docstring. Construct it, then use `generate` from one asyncio loop."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: SchedulerLink | None = None,
        stages: StartupStages | None = None,
    ) -> None:
        """`config`: the server's settings, resolved for this machine. `scheduler`: a child
        already started for `config` (default: start one now). It
        is stopped if the tokenizer or the model fails to load. `stages`: this process's
        start-up stages, marked as it goes (default: its own, from its construction on); with
        the scheduler's, `server_info` reports them."""
        server_args = config.args
        self.server_args = server_args
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.startup = stages or StartupStages("http")
        self._scheduler = scheduler or SchedulerProcess.start(config)
        try:
            self.tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
            self.startup.mark("tokenizer")
            info = tokenizer_info(self.tokenizer)
            self.startup.mark("tokenizer info")
            # travels as its backend's JSON: decodes as that backend does, whose decode serves
            self._backend_decode = info.fast_json is not None
        except BaseException:
            self._scheduler.stop()
            raise
        self._scheduler.introduce(info)  # a child that failed already says why in _wait_ready
        self.metrics = ServerMetrics(
            self.served_model_name if server_args.enable_vllm_metrics else None
        )
        self._states: dict[str, _ReqState] = {}
        self._flushes: deque[asyncio.Future[int]] = deque()  # flush_cache calls awaiting answers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seed_rng = random.Random(server_args.seed)
        self._send_lock = threading.Lock()
        self._dead_reason: str | None = None
        self._closing = False
        ready = self._wait_ready()
        self.startup.mark("wait for the model")
        self.context_len = ready.context_len
        self.vocab_size = ready.vocab_size
        self.max_total_tokens = ready.max_total_tokens
        # the pool's size from start-up, not from the first step's stats
        self.metrics.kv_total.set(ready.max_total_tokens)
        assert server_args.max_running_requests is not None  # resolved for the device
        self.max_running_requests = server_args.max_running_requests
        self.cuda_graphs = config.cuda_graphs
        self.cuda_graph_capture = ready.cuda_graph_capture
        self.scheduler_startup = ready.startup
        self.chunked_prefill_size = ready.chunked_prefill_size
        # structured output: the compiler is made for the first constrained request (importing
        # xgrammar and describing the vocabulary take seconds that most servers never need)
        self._grammar: GrammarCompiler | None = None
        self._grammar_tried = False
        self._grammar_lock = threading.Lock()
        self._held_grammars = HeldGrammars()  # what the scheduler's loader holds
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="tm-reader")
        self._reader.start()

    def _wait_ready(self) -> SchedulerReady:
        msg = self._startup_message()
        if isinstance(msg, SchedulerFailed):
            self._scheduler.stop(timeout_s=5)
            raise SchedulerStartError(msg.error)
        return msg

    def _startup_message(self) -> SchedulerReady | SchedulerFailed:
        """The scheduler's ready (or failed) message; SchedulerFailed too when it exits first,
        or when another tensor-parallel rank exits and rank 0 does not say why soon (it may be
        waiting for that rank to join, which would take the group's whole timeout)."""
        conn = self._scheduler.conn
        try:
            while not conn.poll(STARTUP_POLL_S):
                reason = self._scheduler.follower_exit_reason()
                # rank 0 fails alike when the cause is a flag or the model: its message is better
                if reason is not None and not conn.poll(RANK_EXIT_GRACE_S):
                    return SchedulerFailed(f"{reason} while loading the model")
            return conn.recv()
        except EOFError:
            self._scheduler.join(5)  # for its exit code
            return SchedulerFailed(f"{self._scheduler.exit_reason()} while loading the model")

    # ---- public API -----------------------------------------------------------------------

    def healthy(self) -> bool:
        return self._dead_reason is None and self._scheduler.is_alive()

    def scheduler_exit_reason(self) -> str:
        """Why the scheduler process is gone (once `healthy()` is False); a tensor-parallel
        rank that died first is the cause, whatever rank 0 reported after it."""
        return (
            self._scheduler.follower_exit_reason()
            or self._dead_reason
            or self._scheduler.exit_reason()
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._require_tokenizer()
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Token ids of `messages` through the tokenizer's chat template, by default ready for a
        reply; `options`: chat_input_ids' keyword options."""
        tokenizer = self._require_tokenizer()
        try:
            return chat_input_ids(tokenizer, messages, **options)
        except Exception as err:  # template errors (bad roles, missing content) are input errors
            raise RequestError(f"cannot apply the chat template: {err}", "messages") from err

    @overload
    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]: ...

    @overload
    def generate(
        self, req: GenerateRequest, text_frame: TextFrame | None
    ) -> AsyncIterator[GenerateOutput | bytes]: ...

    async def generate(
        self, req: GenerateRequest, text_frame: TextFrame | None = None
    ) -> AsyncIterator[GenerateOutput | bytes]:
        """Yield output increments until every choice of the request finishes; see
        GenerateOutput (`index` tells the choices apart; each finishes on its own).

        With `text_frame`, an increment that brings new text and nothing else (no finish, no
        logprobs: most of a stream's tokens) comes as `text_frame.render(index, text)`, rendered
        as the scheduler's message is read: a stream then passes it on as it is, or (while it
        waits for the next output with everything before sent) `text_frame.send` writes it at
        once. A choice's first and last increments are always GenerateOutputs.

        Raises RequestError for bad input and ServiceUnavailableError when the scheduler is
        gone, before yielding anything. Closing the generator early aborts the request.
        """
        self._check_alive()
        params = req.sampling_params
        try:
            params.validate()
        except ValueError as err:
            raise RequestError(str(err), str(err).split(" ", 1)[0]) from err
        check_input_ids(req.input_ids, self.vocab_size, self.context_len, self.max_total_tokens)
        check_vocab_ids(params, self.vocab_size)
        max_new = clamp_max_new_tokens(
            len(req.input_ids), params.max_new_tokens, self.context_len, self.max_total_tokens
        )
        self._check_choices(req.n, len(req.input_ids))
        for name in ("top_logprobs", "prompt_logprobs"):
            k = getattr(req, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise RequestError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}", name)
        grammar = await self._compile_grammar(params)
        rids = [req.rid] + [f"{req.rid}-{i}" for i in range(1, req.n)]
        if any(rid in self._states for rid in rids):
            raise RequestError(f"request id {req.rid} is already in flight", "rid")
        self._loop = asyncio.get_running_loop()
        outbox = _Outbox()
        states = [
            _ReqState(outbox, i, self._detokenizer(params), len(req.input_ids), text_frame)
            for i in range(req.n)
        ]
        self._states.update(zip(rids, states, strict=True))
        if params.seed is not None:  # per-choice seeds: reproducible, and distinct
            seeds = [(params.seed + i) % (_MAX_SEED + 1) for i in range(req.n)]
        else:
            seeds = [self._seed_rng.getrandbits(63) for _ in range(req.n)]
        self.metrics.prompt_tokens.inc(len(req.input_ids))
        try:
            self._send(
                TokenizedGenerateReq(
                    rids,
                    list(req.input_ids),
                    params,
                    seeds,
                    max_new,
                    req.top_logprobs,
                    req.prompt_logprobs,
                    grammar,
                )
            )
            unfinished = req.n
            while unfinished:
                for item in _coalesced(await outbox.take()):
                    if isinstance(item, bytes):
                        yield item
                        continue
                    # choices past the first run under rids of their own
                    yield item if item.rid == req.rid else dataclasses.replace(item, rid=req.rid)
                    unfinished -= item.finish_reason is not None
        finally:
            for rid, state in zip(rids, states, strict=True):
                self._states.pop(rid, None)
                if not state.finished and self.healthy():
                    self._send(AbortReq(rid))
                    self._observe_end(state, "abort", time.perf_counter())

    def _check_choices(self, n: int, prompt_len: int) -> None:
        """`n` choices each hold a copy of the prompt's KV and a running slot: they must fit."""
        limit = min(MAX_CHOICES, self.max_running_requests)
        if not 1 <= n <= limit:
            raise RequestError(f"n must be in [1, {limit}], got {n}", "n")
        if n * (prompt_len + 1) > self.max_total_tokens:
            raise RequestError(
                f"n={n} choices of a {prompt_len}-token prompt need {n * (prompt_len + 1)} KV "
                f"slots; this server's KV cache holds {self.max_total_tokens}",
                "n",
            )

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        decode = token_decoder(
            self.tokenizer,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
            self._backend_decode,
        )
        # only a tokenizer that decodes as its backend has a backend to stream through
        step = (
            stream_step(self.tokenizer, params.skip_special_tokens)
            if self._backend_decode
            else None
        )
        return IncrementalDetokenizer(decode, params.stop, step)

    async def health_generate(self) -> bool:
        """Generate one token; False if that fails or takes longer than the timeout."""
        req = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0))

        async def one_token() -> None:
            async for _ in self.generate(req):
                pass

        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except (ServiceUnavailableError, TimeoutError, asyncio.TimeoutError):
            return False
        return True

    def server_info(self) -> dict[str, Any]:
        """Resolved ServerArgs (API key redacted), the sizes the server runs with, the
        start-up stages of this front end and the scheduler (`startup`)."""
        return {
            **self.server_args.redacted(),
            "chunked_prefill_size": self.chunked_prefill_size,  # resolved for the model
            "served_model_name": self.served_model_name,
            "context_len": self.context_len,
            "max_total_tokens": self.max_total_tokens,
            "vocab_size": self.vocab_size,
            "cuda_graph": self.cuda_graphs.to_dict(),
            "cuda_graph_capture": self.cuda_graph_capture,
            "startup": {"http": self.startup.to_dict(), "scheduler": self.scheduler_startup},
            # which front end answered (of --api-server-count)
            "api_server": {"index": self._scheduler.index, "pid": os.getpid()},
            "healthy": self.healthy(),
        }

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the scheduler process to exit; terminate it if it does not in time."""
        self._closing = True
        with self._send_lock:
            self._scheduler.stop(timeout_s)

    # ---- internals --------------------------------------------------------------------------

    def _require_tokenizer(self) -> HFTokenizer:
        """The tokenizer; RequestError when the model has none."""
        if self.tokenizer is None:
            raise RequestError(
                "this model has no tokenizer: send input_ids (POST /generate)", "prompt"
            )
        return self.tokenizer

    async def _compile_grammar(self, params: SamplingParams) -> str | None:
        """The request's structured-output grammar, compiled in a worker thread (a schema can
        take long to compile) and serialized; None without a constraint. RequestError naming
        the field when it is invalid or the server has no grammar engine."""
        constraint = params.constraint
        if constraint is None:
            return None
        compiler = self._grammar
        if not self._grammar_tried:  # the first constrained request makes the compiler
            compiler = await asyncio.to_thread(self._grammar_compiler)
        if compiler is None:
            raise RequestError(
                f"{constraint[0]} needs structured output, which this model does not have: "
                "it has no tokenizer the grammar engine can read",
                constraint[0],
            )
        try:
            return await asyncio.to_thread(compiler.compile, params)
        except ValueError as err:
            raise RequestError(str(err), constraint[0]) from err

    def prepare_structured_output(self) -> threading.Thread | None:
        """Make the grammar compiler on a daemon thread (launch_server: once it serves). Its
        seconds (xgrammar's import, which imports torch, and the vocabulary's description) then
        neither delay the start nor fall on the first constrained request, which waits for the
        thread only if it comes first. None (no thread) for a model without a tokenizer."""
        if self.tokenizer is None:
            return None
        thread = threading.Thread(target=self._grammar_compiler, name="grammar", daemon=True)
        thread.start()
        return thread

    def _grammar_compiler(self) -> GrammarCompiler | None:
        """The grammar compiler, made on the first call (imports xgrammar and describes the
        vocabulary: seconds, off the event loop); None when there is no tokenizer or xgrammar
        cannot read it."""
        with self._grammar_lock:
            if not self._grammar_tried:
                if self.tokenizer is not None:
                    start = time.perf_counter()
                    try:
                        from replaylm.structured.compiler import GrammarCompiler

                        self._grammar = GrammarCompiler.for_tokenizer(
                            self.tokenizer, self.vocab_size
                        )
                    except Exception as err:  # xgrammar unusable here: the rest still serves
                        logger.warning("structured output is off: %s", one_line_error(err))
                    logger.info(
                        "structured output %s (%.1f s)",
                        "ready" if self._grammar is not None else "off",
                        time.perf_counter() - start,
                    )
                self._grammar_tried = True
            return self._grammar

    def _check_alive(self) -> None:
        if self._closing:
            raise ServiceUnavailableError("the server is shutting down")
        if not self.healthy():
            raise ServiceUnavailableError(
                f"the scheduler process is not running: {self._dead_reason or 'it exited'}"
            )

    def _send(self, msg: object) -> None:
        try:
            with self._send_lock:
                if isinstance(msg, TokenizedGenerateReq):
                    self._send_request(msg)
                else:
                    send_message(self._scheduler.conn, msg)
        except (OSError, EOFError) as err:
            raise ServiceUnavailableError(f"cannot reach the scheduler process: {err}") from err

    def _send_request(self, req: TokenizedGenerateReq) -> None:
        """Send `req` (under the send lock) as `HeldGrammars.outgoing` makes it: the pipe's order
        keeps `_held_grammars` in step with the scheduler's loader."""
        constraint = req.sampling_params.constraint
        if constraint is None:
            send_message(self._scheduler.conn, req)
            return
        assert self._grammar is not None  # the request's grammar was compiled
        req = self._held_grammars.outgoing(req, self._grammar.description)
        send_message(self._scheduler.conn, req)
        self._held_grammars.sent(constraint)

    def _read_loop(self) -> None:
        """Reader thread: forward every message to the event loop; report the child's death."""
        while True:
            try:
                msg = self._scheduler.conn.recv()
            except (EOFError, OSError):
                self._scheduler.join(1)  # for its exit code
                reason = detail = self._scheduler.exit_reason()
                break
            if isinstance(msg, SchedulerFailed):  # its error is a traceback
                reason = f"the scheduler process crashed: {msg.error.strip().splitlines()[-1]}"
                detail = f"the scheduler process crashed:\n{msg.error}"
                break
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._on_message, msg)
        if not self._closing:
            logger.error("%s", detail)
        self._dead_reason = reason
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all)

    def _fail_all(self) -> None:
        error = ServiceUnavailableError(self._dead_reason or "scheduler gone")
        for state in self._states.values():
            state.outbox.put(error)
        while self._flushes:
            self._flushes.popleft().set_exception(error)

    def _on_message(self, msg: BatchTokenOut | FlushCacheOut) -> None:
        if isinstance(msg, FlushCacheOut):
            self._flushes.popleft().set_result(msg.freed_tokens)
        else:
            self._on_batch(msg)

    async def flush_cache(self) -> int:
        """Evict every cached prefix no request holds; the number of KV slots freed."""
        self._check_alive()
        self._loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = self._loop.create_future()
        self._flushes.append(done)  # the scheduler answers flushes in order
        self._send(FlushCacheReq())
        return await done

    def _on_batch(self, batch: BatchTokenOut) -> None:
        self.metrics.set_scheduler_stats(batch.stats)
        now = time.perf_counter()
        gaps: list[float] = []  # the per-token series, observed once per batch
        generated = 0
        for out in batch.outputs:
            if isinstance(out, tuple):  # tokens alone: the rest is the last full output's
                rid, ids = out
                state = self._states.get(rid)
                full = None
            else:
                rid, ids, full = out.rid, out.new_token_ids, out
                state = self._states.get(rid)
                if state is not None:
                    state.last_full = out
            if state is None:
                continue
            if ids and state.last_token is not None:
                gaps.append(now - state.last_token)
            generated += len(ids)
            frame = state.text_frame
            if full is None and frame is not None and frame.render is not None:
                text = self._advance(state, ids, None, now)
                if text:  # else nothing to send: the next increment brings it
                    state.outbox.put_frame(frame.render(state.index, text), frame.send)
            else:
                state.outbox.put(self._increment(state, ids, full, now))
        self.metrics.itl.observe_many(gaps)
        self.metrics.generation_tokens.inc(generated)

    def _observe_end(self, state: _ReqState, finish_reason: str, now: float) -> None:
        decode = now - state.first_token if state.first_token is not None else None
        self.metrics.request_ended(
            finish_reason, state.prompt_tokens, state.completion_tokens, now - state.created, decode
        )

    def _advance(
        self, state: _ReqState, ids: list[int], reason: FinishReason | None, now: float
    ) -> str:
        """Advance one choice by the tokens `ids` of one scheduler output (ending it with
        `reason`); observe latencies; the text they release."""
        last = state.last_full
        assert last is not None  # a request's first output is always whole
        if ids:
            if state.last_token is None:
                state.first_token = now
                self.metrics.first_token(now - state.created, state.created_wall, last.admitted_at)
            state.last_token = now
            state.completion_tokens += len(ids)
        text = ""
        if state.detok is not None:
            state.detok.add(ids)
            matched = reason.matched if reason and isinstance(reason.matched, str) else None
            whole = state.detok.final_text(matched) if reason else state.detok.releasable()
            text, state.sent_chars = whole[state.sent_chars :], max(state.sent_chars, len(whole))
        if reason is not None:
            state.finished = True
            self._observe_end(state, reason.type, now)
        return text

    def _increment(
        self, state: _ReqState, ids: list[int], full: ReqTokenOut | None, now: float
    ) -> GenerateOutput:
        """Advance one choice by one scheduler output (`ids`, with `full` the whole output
        when the scheduler sent one); the delta."""
        reason = full.finish_reason if full is not None else None
        text = self._advance(state, ids, reason, now)
        last = state.last_full
        assert last is not None
        return GenerateOutput(
            rid=last.rid,
            text=text,
            token_ids=list(ids),
            logprobs=full.logprobs if full is not None else None,
            finish_reason=reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=state.completion_tokens,
            index=state.index,
            prompt_logprobs=full.prompt_logprobs if full is not None else None,
            cached_tokens=last.cached_tokens,
            spec_verify_ct=last.spec_verify_ct,
            spec_accepted=last.spec_accepted,
        )


def _coalesced(queued: list[GenerateOutput | bytes | Exception]) -> list[GenerateOutput | bytes]:
    """A request's `queued` outputs, in order, with each run of frames joined into one and,
    between frames, each choice's increments joined into one: a consumer that falls behind the
    scheduler then sends one chunk (one write) for several steps' tokens, instead of falling
    further behind. Raises a queued exception."""
    items: list[GenerateOutput | bytes] = []
    joined: dict[int, int] = {}  # choice index -> its increment's place in items since a frame
    for item in queued:
        if isinstance(item, Exception):
            raise item
        if isinstance(item, bytes):
            if items and isinstance(items[-1], bytes):
                items[-1] += item
            else:
                items.append(item)
            joined.clear()
            continue
        at = joined.get(item.index)
        if at is None:
            joined[item.index] = len(items)
            items.append(item)
        else:
            earlier = items[at]
            assert isinstance(earlier, GenerateOutput)
            items[at] = earlier.then(item)
    return items
