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
import contextlib
import logging
import random
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replaylm.model_executor.cuda_graph.config import CudaGraphConfig
from replaylm.model_loader.tokenizer import chat_input_ids, load_tokenizer, tokenizer_info
from replaylm.runtime.detokenizer import IncrementalDetokenizer
from replaylm.runtime.errors import RequestError, ServiceUnavailableError
from replaylm.runtime.io_struct import (
    AbortReq,
    BatchTokenOut,
    GenerateOutput,
    GenerateRequest,
    ReqTokenOut,
    SchedulerFailed,
    SchedulerReady,
    TokenizedGenerateReq,
)
from replaylm.runtime.metrics import ServerMetrics
from replaylm.runtime.request_limits import check_input_ids, clamp_max_new_tokens
from replaylm.runtime.scheduler_process import SchedulerProcess, SchedulerStartError
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


@dataclass
class _ReqState:
    """A request in flight: its output queue, detokenizer and timing for metrics."""

    queue: asyncio.Queue
    detok: IncrementalDetokenizer | None
    prompt_tokens: int
    created: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    completion_tokens: int = 0
    sent_chars: int = 0
    finished: bool = False


class TokenizerManager:
    """See the module docstring. Construct it, then use `generate` from one asyncio loop."""

    def __init__(
        self,
        server_args: ServerArgs,
        cuda_graphs: CudaGraphConfig | None = None,
        scheduler: SchedulerProcess | None = None,
    ) -> None:
        """`cuda_graphs`: the resolved CUDA-graph config, reported by `server_info`;
        `scheduler`: a child already started for `server_args` (default: start one now). It is
        stopped if the tokenizer or the model fails to load."""
        self.server_args = server_args
        self.cuda_graphs = cuda_graphs
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self._scheduler = scheduler or SchedulerProcess.start(server_args)
        try:
            self.tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        except BaseException:
            self._scheduler.stop()
            raise
        with contextlib.suppress(OSError):  # a child that failed already says why in _wait_ready
            self._scheduler.conn.send(tokenizer_info(self.tokenizer))
        self.metrics = ServerMetrics()
        self._states: dict[str, _ReqState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seed_rng = random.Random(server_args.seed)
        self._send_lock = threading.Lock()
        self._dead_reason: str | None = None
        self._closing = False
        ready = self._wait_ready()
        self.context_len = ready.context_len
        self.vocab_size = ready.vocab_size
        self.max_total_tokens = ready.max_total_tokens
        self.cuda_graph_capture = ready.cuda_graph_capture
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="tm-reader")
        self._reader.start()

    def _wait_ready(self) -> SchedulerReady:
        try:
            msg = self._scheduler.conn.recv()
        except EOFError:
            self._scheduler.proc.join(5)  # for its exit code
            msg = SchedulerFailed(f"{self._scheduler.exit_reason()} while loading the model")
        if isinstance(msg, SchedulerFailed):
            self._scheduler.stop(timeout_s=5)
            raise SchedulerStartError(msg.error)
        return msg

    # ---- public API -----------------------------------------------------------------------

    def healthy(self) -> bool:
        return self._dead_reason is None and self._scheduler.proc.is_alive()

    def scheduler_exit_reason(self) -> str:
        """Why the scheduler process is gone (once `healthy()` is False)."""
        return self._dead_reason or self._scheduler.exit_reason()

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

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield output increments until the request finishes; see GenerateOutput.

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
        max_new = clamp_max_new_tokens(
            len(req.input_ids), params.max_new_tokens, self.context_len, self.max_total_tokens
        )
        if req.rid in self._states:
            raise RequestError(f"request id {req.rid} is already in flight", "rid")
        self._loop = asyncio.get_running_loop()
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer else None
        state = _ReqState(asyncio.Queue(), detok, len(req.input_ids))
        self._states[req.rid] = state
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        self.metrics.prompt_tokens.inc(len(req.input_ids))
        try:
            self._send(
                TokenizedGenerateReq(
                    [req.rid], list(req.input_ids), params, [seed], max_new, req.top_logprobs
                )
            )
            while True:
                item = await state.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._states.pop(req.rid, None)
            if not state.finished and self.healthy():
                self._send(AbortReq(req.rid))
                self.metrics.requests.labels("abort").inc()

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
        """Resolved ServerArgs (API key redacted) and the sizes the server runs with."""
        return {
            **self.server_args.redacted(),
            "served_model_name": self.served_model_name,
            "context_len": self.context_len,
            "max_total_tokens": self.max_total_tokens,
            "vocab_size": self.vocab_size,
            "cuda_graph": self.cuda_graphs.to_dict() if self.cuda_graphs else None,
            "cuda_graph_capture": self.cuda_graph_capture,
            "healthy": self.healthy(),
        }

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the scheduler process to exit; terminate it if it does not in time."""
        self._closing = True
        with self._send_lock:
            self._scheduler.stop(timeout_s)

    # ---- internals --------------------------------------------------------------------------

    def _require_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer; RequestError when the model has none."""
        if self.tokenizer is None:
            raise RequestError(
                "this model has no tokenizer: send input_ids (POST /generate)", "prompt"
            )
        return self.tokenizer

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
                self._scheduler.conn.send(msg)
        except (OSError, EOFError) as err:
            raise ServiceUnavailableError(f"cannot reach the scheduler process: {err}") from err

    def _read_loop(self) -> None:
        """Reader thread: forward every message to the event loop; report the child's death."""
        while True:
            try:
                msg = self._scheduler.conn.recv()
            except (EOFError, OSError):
                self._scheduler.proc.join(1)  # for its exit code
                reason = detail = self._scheduler.exit_reason()
                break
            if isinstance(msg, SchedulerFailed):  # its error is a traceback
                reason = f"the scheduler process crashed: {msg.error.strip().splitlines()[-1]}"
                detail = f"the scheduler process crashed:\n{msg.error}"
                break
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._on_batch, msg)
        if not self._closing:
            logger.error("%s", detail)
        self._dead_reason = reason
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all)

    def _fail_all(self) -> None:
        for state in self._states.values():
            state.queue.put_nowait(ServiceUnavailableError(self._dead_reason or "scheduler gone"))

    def _on_batch(self, batch: BatchTokenOut) -> None:
        self.metrics.set_scheduler_stats(batch.stats)
        now = time.perf_counter()
        for out in batch.outputs:
            state = self._states.get(out.rid)
            if state is not None:
                state.queue.put_nowait(self._increment(state, out, now))

    def _increment(self, state: _ReqState, out: ReqTokenOut, now: float) -> GenerateOutput:
        """Advance one request by one scheduler output; observe latencies; build the delta."""
        if out.new_token_ids:
            if state.last_token is None:
                self.metrics.ttft.observe(now - state.created)
            else:
                self.metrics.itl.observe(now - state.last_token)
            state.last_token = now
            state.completion_tokens += len(out.new_token_ids)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
        reason = out.finish_reason
        text = ""
        if state.detok is not None:
            state.detok.add(out.new_token_ids)
            matched = reason.matched if reason and isinstance(reason.matched, str) else None
            full = state.detok.final_text(matched) if reason else state.detok.releasable()
            text, state.sent_chars = full[state.sent_chars :], max(state.sent_chars, len(full))
        if reason is not None:
            state.finished = True
            self.metrics.requests.labels(reason.type).inc()
            self.metrics.e2e.observe(now - state.created)
        return GenerateOutput(
            rid=out.rid,
            text=text,
            token_ids=list(out.new_token_ids),
            logprobs=out.logprobs,
            finish_reason=reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=state.completion_tokens,
        )
