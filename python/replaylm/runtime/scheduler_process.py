"""The scheduler's child process: load the model, then loop — drain requests, step, send outputs.

It talks to the tokenizer manager over one duplex `multiprocessing` pipe. The manager sends
`TokenizerInfo` first (its tokenizer loads while the model does); the process sends
`SchedulerReady` (or `SchedulerFailed`, whose error is one line for the user when the model fails
to load) once, then one `BatchTokenOut` per step that produced tokens or aborts. It exits on
`ShutdownReq` or when the parent end of the pipe closes.

Under tensor parallelism (`--tp-size N`) there is one such process per rank. Only rank 0 has the
pipe; every loop iteration it broadcasts what came through it (requests, aborts, flushes, the
shutdown; at start the TokenizerInfo) to the other ranks, and every rank runs the same scheduler
on that same stream, so all take the same steps (the sampled ids are rank 0's: `RankZeroSampler`).
A rank that dies breaks the others' next collective, which ends them.

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
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from replaylm.device.cuda_context import cuda_device_index, open_in_background
from replaylm.device.triton_key import hash_triton_in_background
from replaylm.distributed.launch import free_loopback_addr
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
from replaylm.startup_stages import StartupStages
from replaylm.structured.loader import GrammarLoader

if TYPE_CHECKING:
    from replaylm.model_executor.engine_config import EngineConfig
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
    """The scheduler child process (rank 0's) and the parent's end of its pipe, with the
    processes of this node's other tensor-parallel ranks (`followers`)."""

    proc: BaseProcess
    conn: Connection
    followers: dict[int, BaseProcess]

    @classmethod
    def start(cls, config: EngineConfig) -> SchedulerProcess:
        """Spawn the child (and the other ranks of node 0) for the resolved `config`; it starts
        loading the model at once (send it TokenizerInfo next). The children get no secrets:
        they have no use for them."""
        config = with_dist_init_addr(
            dataclasses.replace(config, args=dataclasses.replace(config.args, api_key=None))
        )
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=run_scheduler_process,
            args=(config, child_conn, time.time()),
            daemon=True,
            name="replaylm-scheduler",
        )
        proc.start()
        child_conn.close()
        followers = spawn_followers(config, range(1, config.args.ranks_per_node))
        return cls(proc, conn, followers)

    def is_alive(self) -> bool:
        return self.proc.is_alive() and all(p.is_alive() for p in self.followers.values())

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for rank 0's process to exit (for its exit code)."""
        self.proc.join(timeout_s)

    def exit_reason(self) -> str:
        """ "the scheduler process exited", with its exit code once it has one; a follower
        that died first is named instead (rank 0 then fails only as its consequence)."""
        return self.follower_exit_reason() or "the scheduler process exited" + _code(self.proc)

    def follower_exit_reason(self) -> str | None:
        """Which other tensor-parallel rank's process exited, and its code; None while all run."""
        for rank, proc in self.followers.items():
            if not proc.is_alive():
                return f"the scheduler process of tensor-parallel rank {rank} exited{_code(proc)}"
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the children to exit; terminate those that do not in time. Safe to call twice."""
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(ShutdownReq())
        stop_processes([self.proc, *self.followers.values()], timeout_s)
        self.conn.close()


def _code(proc: BaseProcess) -> str:
    return f" (code {proc.exitcode})" if proc.exitcode is not None else ""


def with_dist_init_addr(config: EngineConfig) -> EngineConfig:
    """`config` with the address where its tensor-parallel ranks meet: a free loopback port
    when all ranks run on this machine and none was given."""
    args = config.args
    if args.tp_size == 1 or args.dist_init_addr is not None:
        return config
    return dataclasses.replace(
        config, args=dataclasses.replace(args, dist_init_addr=free_loopback_addr())
    )


def spawn_followers(config: EngineConfig, local_ranks: range) -> dict[int, BaseProcess]:
    """Spawn the scheduler processes of tensor-parallel ranks other than 0, by their index on
    this node (`--node-rank`); {rank: process}."""
    ctx = mp.get_context("spawn")
    procs: dict[int, BaseProcess] = {}
    args = config.args
    for local in local_ranks:
        rank = args.node_rank * args.ranks_per_node + local
        procs[rank] = ctx.Process(
            target=run_scheduler_process,
            args=(config, None, time.time(), rank),
            daemon=True,
            name=f"replaylm-scheduler-tp{rank}",
        )
        procs[rank].start()
    return procs


def stop_processes(procs: list[BaseProcess], timeout_s: float) -> None:
    """Wait up to `timeout_s` for each process to exit, then terminate what still runs."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout_s)


def run_scheduler_process(
    config: EngineConfig, conn: Connection | None, spawned_at: float, tp_rank: int = 0
) -> None:
    """Process entry point; `spawned_at`: when the parent spawned it (epoch seconds), where its
    start-up stages begin. Ctrl-C goes to the parent, which shuts this process down. `conn`:
    the pipe to the tokenizer manager, rank 0's only (None: a follower of tensor-parallel rank
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
    if conn is None:
        sys.exit(_run_follower(config, tp_rank, stages))
    try:
        built = _build_scheduler(config, conn, stages)
        if built is None:
            return  # shut down before it was ready
        scheduler, grammars = built
        runner = scheduler.runner
        stages.log_summary()
        conn.send(
            SchedulerReady(
                max_total_tokens=runner.kv.size,
                context_len=runner.kv.context_len,
                vocab_size=runner.config.vocab_size,
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
    except Exception as err:
        if _group_broken(err):  # another rank died: its death is the story, not this traceback
            logger.error("scheduler stops: %s", one_line_error(err))
            conn.send(SchedulerFailed(one_line_error(err)))
            return
        logger.exception("scheduler crashed")
        conn.send(SchedulerFailed(traceback.format_exc()))


def _group_broken(err: Exception) -> bool:
    """Whether `err` is the tensor-parallel group breaking (a rank gone), not a bug here."""
    if "torch.distributed" not in sys.modules:
        return False
    from replaylm.distributed.communication import GroupBroken

    return isinstance(err, GroupBroken)


def one_line_error(err: BaseException) -> str:
    """`err` as one line for the user: its message, after its type's name unless it is one of
    the errors whose messages are written for users."""
    message = " ".join(str(err).split())
    if isinstance(err, _USER_ERRORS) and message:
        return message
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def _run_follower(config: EngineConfig, tp_rank: int, stages: StartupStages) -> int:
    """A follower rank's life: its exit code, 0 after rank 0's ShutdownReq, 1 (one log line
    saying why) when anything fails, a broken group included. A start-up failure on node 0 is
    logged quietly: rank 0 fails alike (the same flags and model) and the front end says why."""
    started = False
    try:
        built = _build_scheduler(config, None, stages, tp_rank)
        if built is not None:
            started = True
            # its batches are rank 0's, which logs them
            logging.getLogger("replaylm.runtime.scheduler").setLevel(logging.WARNING)
            _loop(built[0], None, built[1])
        return 0
    except Exception as err:
        logger.debug("tensor-parallel rank %d failed", tp_rank, exc_info=True)
        level = logging.ERROR if started or config.args.node_rank > 0 else logging.INFO
        logger.log(level, "tensor-parallel rank %d stops: %s", tp_rank, one_line_error(err))
        return 1


def _build_scheduler(
    config: EngineConfig, conn: Connection | None, stages: StartupStages, tp_rank: int = 0
) -> tuple[Scheduler, GrammarLoader] | None:
    """Load the model, then take the manager's TokenizerInfo (a follower rank: rank 0's
    broadcast of it); the scheduler and the loader of structured-output grammars (which the
    first grammar brings the vocabulary to), or None if the manager sent ShutdownReq."""
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
    return scheduler, GrammarLoader(runner.config.vocab_size, eos)


def _first_message(conn: Connection | None, tp_size: int) -> object:
    """The manager's first message (rank 0 passes it on to the other ranks); a follower rank
    (`conn` None) gets it from rank 0."""
    if tp_size == 1:
        assert conn is not None  # without tensor parallelism the one process has the pipe
        return conn.recv()
    from replaylm.distributed.communication import broadcast_objects

    return broadcast_objects(None if conn is None else [conn.recv()])[0]


def _receive(conn: Connection | None, scheduler: Scheduler, tp_size: int) -> list[object]:
    """This iteration's messages: what came through the pipe (waiting while there is no work),
    and under tensor parallelism rank 0's list on every rank. A closed pipe reads as a
    ShutdownReq, so the other ranks stop too."""
    messages: list[object] = []
    if conn is not None:
        timeout = 0.0 if scheduler.has_work else IDLE_POLL_S
        try:
            while conn.poll(timeout):
                messages.append(conn.recv())
                timeout = 0.0
        except (EOFError, BrokenPipeError):
            logger.info("parent process gone; scheduler exiting")
            messages.append(ShutdownReq())
    if tp_size == 1:
        return messages
    from replaylm.distributed.communication import broadcast_objects

    return broadcast_objects(messages if conn is not None else None)


def _loop(scheduler: Scheduler, conn: Connection | None, grammars: GrammarLoader) -> None:
    """Apply each iteration's messages, then step; `conn` None on a follower rank, which
    takes rank 0's messages and sends nothing."""
    tp_size = scheduler.runner.tp.size
    while True:
        aborted: list[Req] = []
        for msg in _receive(conn, scheduler, tp_size):
            if isinstance(msg, ShutdownReq):
                if tp_size > 1:
                    from replaylm.distributed.communication import part_together

                    scheduler.runner.free_cuda_graphs()
                    part_together()
                return
            if isinstance(msg, TokenizedGenerateReq):
                scheduler.add(request_of(msg, _load_grammar(msg, grammars)))
            elif isinstance(msg, AbortReq) and (req := scheduler.abort(msg.rid)) is not None:
                aborted.append(req)
            elif isinstance(msg, FlushCacheReq):
                flushed = scheduler.prefix_cache.flush()
                if conn is not None:
                    conn.send(FlushCacheOut(flushed))
        if conn is None:  # a follower: the same steps, no outputs
            if scheduler.has_work:
                scheduler.step()
            continue
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
                    spec_verify_ct=o.req.spec_verify_ct,
                    spec_accepted=o.req.spec_accepted,
                    admitted_at=o.req.admitted_at,
                )
                for o in scheduler.step()
            ]
        if outputs or aborted:
            conn.send(BatchTokenOut(outputs, scheduler.stats()))


def request_of(msg: TokenizedGenerateReq, grammar: RequestGrammar | None) -> Req:
    """The scheduler's request for `msg` (its first choice; the others are its forks)."""
    return Req(
        msg.rids[0],
        msg.input_ids,
        msg.sampling_params,
        msg.seeds[0],
        msg.max_new_tokens,
        top_logprobs=msg.top_logprobs,
        prompt_logprobs=msg.prompt_logprobs,
        forks=list(zip(msg.rids[1:], msg.seeds[1:], strict=True)),
        grammar=grammar,
    )


def _load_grammar(msg: TokenizedGenerateReq, grammars: GrammarLoader) -> RequestGrammar | None:
    """The request's grammar; every constrained request must come here, in the pipe's order,
    since the manager's `HeldGrammars` replays what the loader keeps."""
    constraint = msg.sampling_params.constraint
    if constraint is None:
        return None
    return grammars.load(constraint, msg.grammar, msg.grammar_vocabulary)
