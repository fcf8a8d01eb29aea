"""The scheduler's child process: load the model, then loop — drain requests, step, send outputs.

It talks to the tokenizer manager over one duplex `multiprocessing` pipe. It sends
`SchedulerReady` (or `SchedulerFailed`) once, then one `BatchTokenOut` per step that produced
tokens or aborts. It exits on `ShutdownReq` or when the parent end of the pipe closes.
"""

from __future__ import annotations

import logging
import signal
import traceback
from functools import partial
from multiprocessing.connection import Connection

from replaylm.runtime.io_struct import (
    AbortReq,
    BatchTokenOut,
    ReqTokenOut,
    SchedulerFailed,
    SchedulerReady,
    ShutdownReq,
    TokenizedGenerateReq,
)
from replaylm.runtime.model_setup import load_runner_and_tokenizer
from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.server_args import ServerArgs

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5


def run_scheduler_process(args: ServerArgs, conn: Connection) -> None:
    """Process entry point. Ctrl-C goes to the parent, which shuts this process down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [scheduler] %(name)s: %(message)s")
    try:
        runner, tokenizer, eos_ids = load_runner_and_tokenizer(args)
        decode = partial(tokenizer.decode, skip_special_tokens=True) if tokenizer else None
        scheduler = Scheduler(
            runner, eos_ids, decode, args.chunked_prefill_size, args.max_prefill_tokens
        )
        conn.send(SchedulerReady(
            max_total_tokens=runner.max_total_tokens, context_len=runner.context_len,
            vocab_size=runner.config.vocab_size, cuda_graph_capture=runner.cuda_graph_stats(),
        ))
    except Exception:
        conn.send(SchedulerFailed(traceback.format_exc()))
        return
    try:
        _loop(scheduler, conn)
    except (EOFError, BrokenPipeError):
        logger.info("parent process gone; scheduler exiting")
    except Exception:
        logger.exception("scheduler crashed")
        conn.send(SchedulerFailed(traceback.format_exc()))


def _loop(scheduler: Scheduler, conn: Connection) -> None:
    while True:
        aborted: list[Req] = []
        timeout = 0.0 if scheduler.has_work else IDLE_POLL_S
        while conn.poll(timeout):
            msg = conn.recv()
            timeout = 0.0
            if isinstance(msg, ShutdownReq):
                return
            if isinstance(msg, TokenizedGenerateReq):
                scheduler.add(Req(
                    msg.rid, msg.input_ids, msg.sampling_params, msg.seed, msg.max_new_tokens,
                    top_logprobs=msg.top_logprobs,
                ))
            elif isinstance(msg, AbortReq) and (req := scheduler.abort(msg.rid)) is not None:
                aborted.append(req)
        outputs = [
            ReqTokenOut(r.rid, [], None, r.finish_reason, len(r.input_ids)) for r in aborted
        ]
        if scheduler.has_work:
            outputs += [
                ReqTokenOut(o.req.rid, o.new_token_ids, o.logprobs, o.req.finish_reason,
                            len(o.req.input_ids))
                for o in scheduler.step()
            ]
        if outputs or aborted:
            conn.send(BatchTokenOut(outputs, scheduler.stats()))
