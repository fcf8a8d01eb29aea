"""The scheduler's child process: load the model, then loop — take the front ends' messages,
step, send each front end the outputs of its requests.

It talks to each HTTP front end (`--api-server-count`, one by default) over a duplex
`multiprocessing` pipe of its own. Front end 0, the main process, sends `TokenizerInfo` first
(its tokenizer loads while the model does); the process sends `SchedulerReady` (or
`SchedulerFailed`, whose error is one line for the user when the model fails to load) to every
front end once, then per step one `BatchTokenOut` to each front end whose requests produced
tokens or were aborted. Requests are keyed by (front end, rid), so the front ends' ids never
clash. It exits on `ShutdownReq` or when front end 0's pipe closes; another front end's pipe
closing aborts that front end's requests (the main process decides whether the server goes on).

Under tensor parallelism (`--tp-size N`) there is one such process per rank. Only rank 0 has the
pipes; every loop iteration it broadcasts what came through them (requests, aborts, flushes, the
shutdown; at start the TokenizerInfo) to the other ranks, and every rank runs the same scheduler
on that same stream, so all take the same steps (the sampled ids are rank 0's: `RankZeroSampler`).
A rank that dies breaks the others' next collective, which ends them.

Nothing heavy is imported at the top: the HTTP process imports this module to spawn the child,
and torch and the model code load in the child only.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, cast

from replaylm.device.cuda_context import cuda_device_index, open_in_background
from replaylm.device.triton_key import hash_triton_in_background
from replaylm.model_loader.tokenizer import TokenizerInfo, scheduler_decoder
from replaylm.runtime.errors import one_line_error
from replaylm.runtime.io_struct import (
    AbortReq,
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    PlainTokenOut,
    ReqTokenOut,
    SchedulerFailed,
    SchedulerReady,
    ShutdownReq,
    TokenizedGenerateReq,
    send_message,
)
from replaylm.runtime.request import Req
from replaylm.startup_stages import StartupStages
from replaylm.structured.loader import GrammarLoader

if TYPE_CHECKING:
    from replaylm.model_executor.engine_config import EngineConfig
    from replaylm.runtime.io_struct import TokenLogprob
    from replaylm.runtime.scheduler import Scheduler, StepOutput
    from replaylm.structured.grammar import RequestGrammar

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5


@dataclass
class FrontEndGone:
    """A front end's pipe closed (its process exited): its requests are aborted."""


# a request's id in this process: (its front end's index, the id that front end gave it)
RequestKey = tuple[int, str]
# (front end index, message): what one loop iteration applies, on every rank
Message = tuple[int, object]


class FrontEnds:
    """Rank 0's pipes to the front ends, by index; a closed one is dropped."""

    def __init__(self, conns: list[Connection]) -> None:
        self.open = dict(enumerate(conns))

    def receive(self, timeout: float) -> list[Message]:
        """Every message waiting on any pipe, after waiting up to `timeout` for the first. A
        closed pipe reads as a ShutdownReq (front end 0: the main process is gone) or as
        FrontEndGone."""
        messages: list[Message] = []
        ready = wait(list(self.open.values()), timeout)
        for index, conn in list(self.open.items()):
            if conn not in ready:
                continue
            try:
                while conn.poll():
                    messages.append((index, conn.recv()))
            except (EOFError, OSError):
                del self.open[index]
                if index == 0:
                    logger.info("parent process gone; scheduler exiting")
                messages.append((index, ShutdownReq() if index == 0 else FrontEndGone()))
        return messages

    def send(self, index: int, msg: object) -> None:
        """Send `msg` to front end `index`; one that is gone misses it (its pipe's end then
        reads as closed, and `receive` reports it), but front end 0 must be there."""
        conn = self.open.get(index)
        if conn is None:
            return
        try:
            send_message(conn, msg)
        except OSError:
            if index == 0:
                raise

    def send_all(self, msg: object) -> None:
        for index in list(self.open):
            self.send(index, msg)


def run_scheduler_process(
    config: EngineConfig, conns: list[Connection] | None, spawned_at: float, tp_rank: int = 0
) -> None:
    """Process entry point; `spawned_at`: when the parent spawned it (epoch seconds), where its
    start-up stages begin. Ctrl-C goes to the parent, which shuts this process down. `conns`:
    the pipes to the front ends, rank 0's only (None: a follower of tensor-parallel rank
    `tp_rank`, which exits with code 1 when it fails)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = config.args
    gpu = cuda_device_index(args.device, args.tp_size, tp_rank, args.ranks_per_node)
    if gpu is not None:  # the context and Triton's cache key are made beside the imports below
        open_in_background(gpu)
        hash_triton_in_background()
    name = "scheduler" if args.tp_size == 1 else f"scheduler tp{tp_rank}"
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    stages = StartupStages("scheduler", spawned_at)
    stages.mark("spawn")
    logger.info("scheduler process started: importing torch and the model code")
    if conns is None:
        sys.exit(_run_follower(config, tp_rank, stages))
    front = FrontEnds(conns)
    try:
        scheduler = _build_scheduler(config, conns[0], stages)
        if scheduler is None:
            return  # shut down before it was ready
        runner = scheduler.runner
        stages.log_summary()
        front.send_all(
            SchedulerReady(
                max_total_tokens=runner.kv.size,
                context_len=runner.kv.context_len,
                vocab_size=runner.config.vocab_size,
                cuda_graph_capture=runner.cuda_graph_stats(),
                startup=stages.to_dict(),
                chunked_prefill_size=scheduler.chunk_size,
            )
        )
    except (EOFError, BrokenPipeError):
        return  # the parent gave up before the model was ready
    except Exception as err:
        logger.debug("loading the model failed", exc_info=True)
        front.send_all(SchedulerFailed(one_line_error(err)))
        return
    try:
        _loop(scheduler, front)
    except (EOFError, BrokenPipeError):
        logger.info("parent process gone; scheduler exiting")
    except Exception as err:
        if _group_broken(err):  # another rank died: its death is the story, not this traceback
            logger.error("scheduler stops: %s", one_line_error(err))
            front.send_all(SchedulerFailed(one_line_error(err)))
            return
        logger.exception("scheduler crashed")
        front.send_all(SchedulerFailed(traceback.format_exc()))


def _group_broken(err: Exception) -> bool:
    """Whether `err` is the tensor-parallel group breaking (a rank gone), not a bug here."""
    if "torch.distributed" not in sys.modules:
        return False
    from replaylm.distributed.communication import GroupBroken

    return isinstance(err, GroupBroken)


def _run_follower(config: EngineConfig, tp_rank: int, stages: StartupStages) -> int:
    """A follower rank's life: its exit code, 0 after rank 0's ShutdownReq, 1 (one log line
    saying why) when anything fails, a broken group included. A start-up failure on node 0 is
    logged quietly: rank 0 fails alike (the same flags and model) and the front end says why."""
    started = False
    try:
        scheduler = _build_scheduler(config, None, stages, tp_rank)
        if scheduler is not None:
            started = True
            # its batches are rank 0's, which logs them
            logging.getLogger("replaylm.runtime.scheduler").setLevel(logging.WARNING)
            _loop(scheduler, None)
        return 0
    except Exception as err:
        logger.debug("tensor-parallel rank %d failed", tp_rank, exc_info=True)
        level = logging.ERROR if started or config.args.node_rank > 0 else logging.INFO
        logger.log(level, "tensor-parallel rank %d stops: %s", tp_rank, one_line_error(err))
        return 1


def _build_scheduler(
    config: EngineConfig, conn: Connection | None, stages: StartupStages, tp_rank: int = 0
) -> Scheduler | None:
    """Load the model, then take front end 0's TokenizerInfo (a follower rank: rank 0's
    broadcast of it); the scheduler, or None if the front end sent ShutdownReq."""
    from replaylm.model_executor.runner_setup import load_model_runners
    from replaylm.runtime.model_setup import eos_token_ids
    from replaylm.runtime.scheduler import Scheduler

    stages.mark("imports")
    args = config.args
    runner, draft = load_model_runners(config, stages, tp_rank)
    info = _first_message(conn, args.tp_size)
    if isinstance(info, ShutdownReq):
        return None
    if not isinstance(info, TokenizerInfo):
        raise TypeError(f"expected TokenizerInfo first, got {type(info).__name__}")
    stages.mark("wait for the tokenizer")
    decode = scheduler_decoder(info, args.tokenizer_path or args.model_path)
    eos = eos_token_ids(runner, info.eos_token_id)
    scheduler = Scheduler.from_args(runner, eos, decode, args, draft)
    stages.mark("scheduler")
    return scheduler


def _first_message(conn: Connection | None, tp_size: int) -> object:
    """Front end 0's first message (rank 0 passes it on to the other ranks); a follower rank
    (`conn` None) gets it from rank 0."""
    if tp_size == 1:
        assert conn is not None  # without tensor parallelism the one process has the pipes
        return conn.recv()
    from replaylm.distributed.communication import broadcast_objects

    return broadcast_objects(None if conn is None else [conn.recv()])[0]


def _receive(front: FrontEnds | None, scheduler: Scheduler, tp_size: int) -> list[Message]:
    """This iteration's messages: what came through the pipes (waiting while there is no work),
    and under tensor parallelism rank 0's list on every rank."""
    messages: list[Message] = []
    if front is not None:
        messages = front.receive(0.0 if scheduler.has_work else IDLE_POLL_S)
    if tp_size == 1:
        return messages
    from replaylm.distributed.communication import broadcast_objects

    return broadcast_objects(messages if front is not None else None)


def _loop(scheduler: Scheduler, front: FrontEnds | None) -> None:
    """Apply each iteration's messages, then step; `front` None on a follower rank, which
    takes rank 0's messages and sends nothing. Each front end has a grammar loader of its own:
    its manager's `HeldGrammars` replays what that loader keeps, in its pipe's order."""
    tp_size = scheduler.runner.tp.size
    loaders: dict[int, GrammarLoader] = {}
    while True:
        aborted: list[Req] = []
        for index, msg in _receive(front, scheduler, tp_size):
            if isinstance(msg, ShutdownReq):
                if tp_size > 1:
                    from replaylm.distributed.communication import part_together

                    scheduler.runner.free_cuda_graphs()
                    part_together()
                return
            if isinstance(msg, TokenizedGenerateReq):
                if index not in loaders:
                    loaders[index] = GrammarLoader(
                        scheduler.runner.config.vocab_size, scheduler.eos_ids
                    )
                grammar = _load_grammar(msg, loaders[index])
                scheduler.add(request_of(msg, grammar, index))
            elif isinstance(msg, AbortReq):
                if (req := scheduler.abort((index, msg.rid))) is not None:
                    aborted.append(req)
            elif isinstance(msg, FrontEndGone):
                logger.warning("front end %d is gone: its requests are aborted", index)
                aborted += _abort_front_end(scheduler, index)
                loaders.pop(index, None)
            elif isinstance(msg, FlushCacheReq):
                flushed = scheduler.prefix_cache.flush()
                if front is not None:
                    front.send(index, FlushCacheOut(flushed))
        if front is None:  # a follower: the same steps, no outputs
            if scheduler.has_work:
                scheduler.step()
            continue
        outputs: list[tuple[Req, ReqTokenOut | PlainTokenOut]]
        outputs = [(r, _full_output(r, [])) for r in aborted]
        if scheduler.has_work:
            outputs += [(o.req, _output(o)) for o in scheduler.step()]
        if outputs:
            _send_outputs(front, outputs, scheduler)


def _output(o: StepOutput) -> ReqTokenOut | PlainTokenOut:
    """A step's output for a request's front end: a PlainTokenOut when it only brings tokens
    after the request's first (the front end keeps the rest from its last ReqTokenOut)."""
    req = o.req
    plain = o.logprobs is None and o.prompt_logprobs is None and req.finish_reason is None
    if plain and len(req.output_ids) > len(o.new_token_ids):
        return _rid(req), o.new_token_ids
    return _full_output(req, o.new_token_ids, o.logprobs, o.prompt_logprobs)


def _full_output(
    req: Req,
    new_token_ids: list[int],
    logprobs: list[TokenLogprob] | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
) -> ReqTokenOut:
    return ReqTokenOut(
        _rid(req),
        new_token_ids,
        logprobs,
        req.finish_reason,
        len(req.input_ids),
        prompt_logprobs=prompt_logprobs,
        cached_tokens=req.cached_tokens,
        spec_verify_ct=req.spec_verify_ct,
        spec_accepted=req.spec_accepted,
        admitted_at=req.admitted_at,
    )


def _send_outputs(
    front: FrontEnds,
    outputs: list[tuple[Req, ReqTokenOut | PlainTokenOut]],
    scheduler: Scheduler,
) -> None:
    """One BatchTokenOut to each front end with outputs in this step, with the step's stats."""
    stats = scheduler.stats()
    by_front: dict[int, list[ReqTokenOut | PlainTokenOut]] = {}
    for req, out in outputs:
        by_front.setdefault(_front_end(req), []).append(out)
    for index, outs in by_front.items():
        front.send(index, BatchTokenOut(outs, stats))


def _front_end(req: Req) -> int:
    return cast(RequestKey, req.rid)[0]


def _rid(req: Req) -> str:
    """The request's id as its front end knows it."""
    return cast(RequestKey, req.rid)[1]


def _abort_front_end(scheduler: Scheduler, index: int) -> list[Req]:
    """Abort every request (and pending choice) of front end `index`."""
    rids = [
        rid
        for queue in (scheduler.running, scheduler.waiting)
        for req in queue
        for rid in (req.rid, *(fork for fork, _ in req.forks))
        if cast(RequestKey, rid)[0] == index
    ]
    return [req for rid in rids if (req := scheduler.abort(rid)) is not None]


def request_of(
    msg: TokenizedGenerateReq, grammar: RequestGrammar | None, front_end: int = 0
) -> Req:
    """The scheduler's request for `msg` from front end `front_end` (its first choice; the
    others are its forks), its ids keyed by the front end."""
    return Req(
        (front_end, msg.rids[0]),
        msg.input_ids,
        msg.sampling_params,
        msg.seeds[0],
        msg.max_new_tokens,
        top_logprobs=msg.top_logprobs,
        prompt_logprobs=msg.prompt_logprobs,
        forks=[
            ((front_end, rid), seed) for rid, seed in zip(msg.rids[1:], msg.seeds[1:], strict=True)
        ],
        grammar=grammar,
    )


def _load_grammar(msg: TokenizedGenerateReq, grammars: GrammarLoader) -> RequestGrammar | None:
    """The request's grammar; every constrained request of a front end must come here, in its
    pipe's order, since that manager's `HeldGrammars` replays what the loader keeps."""
    constraint = msg.sampling_params.constraint
    if constraint is None:
        return None
    return grammars.load(constraint, msg.grammar, msg.grammar_vocabulary)
