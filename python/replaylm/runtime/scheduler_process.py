"""The scheduler's child process: load the model, then loop — drain requests, step, send outputs.

It talks to the tokenizer manager over one duplex `multiprocessing` pipe. The manager sends
`TokenizerInfo` first (its tokenizer loads while the model does); the process sends
`SchedulerReady` (or `SchedulerFailed`, whose error is one line for the user when the model fails
to load) once, then one `BatchTokenOut` per step that produced tokens or aborts. It exits on
`ShutdownReq` or when the parent end of the pipe closes.

This module is imported by the HTTP process (to start the child), so it imports nothing heavy at
the top: torch and the model code load in the child only, while the parent goes on with its own
start-up (loading the tokenizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from replaylm.model_loader.tokenizer import TokenizerInfo, scheduler_decoder
from replaylm.runtime.io_struct import (
    AbortReq,
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    ReqTokenOut,
    SchedulerFailed,
    SchedulerReady,
    ShutdownReq,
    TokenizedGenerateReq,
)
from replaylm.runtime.request import Req
from replaylm.server_args import ServerArgs
from replaylm.startup_stages import StartupStages
from replaylm.structured.loader import GrammarLoader

if TYPE_CHECKING:
    from replaylm.runtime.scheduler import Scheduler
    from replaylm.structured.grammar import RequestGrammar

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
# errors whose messages are written for users (bad paths, checkpoints, flags, out of memory)
_USER_ERRORS = (ValueError, OSError, RuntimeError)


class SchedulerStartError(RuntimeError):
    """The scheduler process could not load the model; the message is one line for the user."""


@dataclass
class SchedulerProcess:
    """The scheduler child process and the parent's end of its pipe."""

    proc: BaseProcess
    conn: Connection

    @classmethod
    def start(cls, args: ServerArgs) -> SchedulerProcess:
        """Spawn the child; it starts loading the model at once (send it TokenizerInfo next).
        The child gets no secrets: it has no use for them."""
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=run_scheduler_process,
            args=(dataclasses.replace(args, api_key=None), child_conn, time.time()),
            daemon=True,
            name="replaylm-scheduler",
        )
        proc.start()
        child_conn.close()
        return cls(proc, conn)

    def exit_reason(self) -> str:
        """ "the scheduler process exited", with its exit code once it has one."""
        code = self.proc.exitcode
        return "the scheduler process exited" + (f" (code {code})" if code is not None else "")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the child to exit; terminate it if it does not in time. Safe to call twice."""
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(ShutdownReq())
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout_s)
        self.conn.close()


def run_scheduler_process(args: ServerArgs, conn: Connection, spawned_at: float) -> None:
    """Process entry point; `spawned_at`: when the parent spawned it (epoch seconds), where its
    start-up stages begin. Ctrl-C goes to the parent, which shuts this process down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [scheduler] %(name)s: %(message)s",
    )
    stages = StartupStages("scheduler", spawned_at)
    stages.mark("spawn")
    logger.info("scheduler process started: importing torch and the model code")
    try:
        built = _build_scheduler(args, conn, stages)
        if built is None:
            return  # shut down before it was ready
        scheduler, grammars = built
        runner = scheduler.runner
        stages.log_summary()
        conn.send(
            SchedulerReady(
                max_total_tokens=runner.max_total_tokens,
                context_len=runner.context_len,
                vocab_size=runner.config.vocab_size,
                max_running_requests=runner.max_running_requests,
                cuda_graphs=runner.cuda_graphs,
                cuda_graph_capture=runner.cuda_graph_stats(),
                startup=stages.to_dict(),
            )
        )
    except (EOFError, BrokenPipeError):
        return  # the parent gave up before the model was ready
    except Exception as err:
        logger.debug("loading the model failed", exc_info=True)
        conn.send(SchedulerFailed(one_line_error(err)))
        return
    try:
        _loop(scheduler, conn, grammars)
    except (EOFError, BrokenPipeError):
        logger.info("parent process gone; scheduler exiting")
    except Exception:
        logger.exception("scheduler crashed")
        conn.send(SchedulerFailed(traceback.format_exc()))


def one_line_error(err: BaseException) -> str:
    """`err` as one line for the user: its message, after its type's name unless it is one of
    the errors whose messages are written for users."""
    message = " ".join(str(err).split())
    if isinstance(err, _USER_ERRORS) and message:
        return message
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def _build_scheduler(
    args: ServerArgs, conn: Connection, stages: StartupStages
) -> tuple[Scheduler, GrammarLoader | None] | None:
    """Load the model, then take the manager's TokenizerInfo; the scheduler and the loader of
    structured-output grammars (None: no structured output), or None if it sent ShutdownReq."""
    from replaylm.model_executor.model_runner import ModelRunner
    from replaylm.runtime.model_setup import eos_token_ids
    from replaylm.runtime.scheduler import Scheduler

    stages.mark("imports")
    runner = ModelRunner(args, stages)
    info = conn.recv()
    if isinstance(info, ShutdownReq):
        return None
    if not isinstance(info, TokenizerInfo):
        raise TypeError(f"expected TokenizerInfo first, got {type(info).__name__}")
    stages.mark("wait for the tokenizer")
    decode = scheduler_decoder(info, args.tokenizer_path or args.model_path)
    eos = eos_token_ids(runner, info.eos_token_id)
    scheduler = Scheduler.from_args(runner, eos, decode, args)
    vocabulary = info.grammar_vocabulary
    grammars = GrammarLoader(vocabulary, runner.config.vocab_size, eos) if vocabulary else None
    stages.mark("scheduler")
    return scheduler, grammars


def _loop(scheduler: Scheduler, conn: Connection, grammars: GrammarLoader | None) -> None:
    while True:
        aborted: list[Req] = []
        timeout = 0.0 if scheduler.has_work else IDLE_POLL_S
        while conn.poll(timeout):
            msg = conn.recv()
            timeout = 0.0
            if isinstance(msg, ShutdownReq):
                return
            if isinstance(msg, TokenizedGenerateReq):
                scheduler.add(
                    Req(
                        msg.rids[0],
                        msg.input_ids,
                        msg.sampling_params,
                        msg.seeds[0],
                        msg.max_new_tokens,
                        top_logprobs=msg.top_logprobs,
                        prompt_logprobs=msg.prompt_logprobs,
                        forks=list(zip(msg.rids[1:], msg.seeds[1:], strict=True)),
                        grammar=_load_grammar(msg, grammars),
                    )
                )
            elif isinstance(msg, AbortReq) and (req := scheduler.abort(msg.rid)) is not None:
                aborted.append(req)
            elif isinstance(msg, FlushCacheReq):
                conn.send(FlushCacheOut(scheduler.kv.flush()))
        outputs = [ReqTokenOut(r.rid, [], None, r.finish_reason, len(r.input_ids)) for r in aborted]
        if scheduler.has_work:
            outputs += [
                ReqTokenOut(
                    o.req.rid,
                    o.new_token_ids,
                    o.logprobs,
                    o.req.finish_reason,
                    len(o.req.input_ids),
                    prompt_logprobs=o.prompt_logprobs,
                    cached_tokens=o.req.cached_tokens,
                    admitted_at=o.req.admitted_at,
                )
                for o in scheduler.step()
            ]
        if outputs or aborted:
            conn.send(BatchTokenOut(outputs, scheduler.stats()))


def _load_grammar(
    msg: TokenizedGenerateReq, grammars: GrammarLoader | None
) -> RequestGrammar | None:
    """The request's grammar; every constrained request must come here, in the pipe's order,
    since the manager's `HeldGrammars` replays what the loader keeps."""
    constraint = msg.sampling_params.constraint
    if constraint is None:
        return None
    if grammars is None:  # the manager compiles grammars only with a grammar vocabulary
        raise RuntimeError("a request came with a grammar, but structured output is off")
    return grammars.load(constraint, msg.grammar)
