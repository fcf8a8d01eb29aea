"""The front ends' handles on the scheduler process (`scheduler_loop` is what runs in it).

`SchedulerProcess` is the main process's: it spawns the child (and this node's other
tensor-parallel ranks) with one pipe per HTTP front end (`--api-server-count`), keeps front end
0's pipe, and stops the children. `SchedulerPipe` is another front end's, in a process of its own:
only its pipe, whose closing tells it the scheduler is gone.

This module is imported by the HTTP processes, so it imports nothing heavy at the top: torch and
the model code load in the child only, while the parent goes on with its own start-up (loading
the tokenizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from replaylm.distributed.launch import free_loopback_addr
from replaylm.model_loader.tokenizer import TokenizerInfo
from replaylm.runtime.io_struct import ShutdownReq
from replaylm.runtime.scheduler_loop import run_scheduler_process

if TYPE_CHECKING:
    from replaylm.model_executor.engine_config import EngineConfig


class SchedulerStartError(RuntimeError):
    """The scheduler process could not load the model; the message is one line for the user."""


@dataclass
class SchedulerProcess:
    """The scheduler child process (rank 0's) and the main process's end of front end 0's pipe,
    with the processes of this node's other tensor-parallel ranks (`followers`) and the ends of
    the other front ends' pipes (`front_end_conns`: launch_server hands each to its process,
    then closes them here, so that a front end's exit closes its pipe)."""

    proc: BaseProcess
    conn: Connection
    followers: dict[int, BaseProcess]
    front_end_conns: list[Connection]
    index = 0  # the main process is front end 0

    @classmethod
    def start(cls, config: EngineConfig, front_ends: int = 1) -> SchedulerProcess:
        """Spawn the child (and the other ranks of node 0) for the resolved `config`, with a
        pipe for each of `front_ends`; it starts loading the model at once (send it
        TokenizerInfo next: `introduce`). The children get no secrets: they have no use for
        them."""
        config = with_dist_init_addr(
            dataclasses.replace(config, args=dataclasses.replace(config.args, api_key=None))
        )
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(front_ends)]
        proc = ctx.Process(
            target=run_scheduler_process,
            args=(config, [child for _, child in pipes], time.time()),
            daemon=True,
            name="replaylm-scheduler",
        )
        proc.start()
        for _, child in pipes:
            child.close()
        followers = spawn_followers(config, range(1, config.args.ranks_per_node))
        return cls(proc, pipes[0][0], followers, [conn for conn, _ in pipes[1:]])

    def introduce(self, info: TokenizerInfo) -> None:
        """Send the tokenizer's description, which the scheduler waits for after the model."""
        with contextlib.suppress(OSError):  # a child that failed already says why
            self.conn.send(info)

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
        for conn in self.front_end_conns:
            conn.close()


@dataclass
class SchedulerPipe:
    """A front end other than the main process: its pipe to the scheduler process, which the
    main process owns (starts, watches, stops). The pipe closing is how it learns the scheduler
    is gone, so `is_alive` leaves that to the manager's reader."""

    conn: Connection
    index: int  # the front end's (1 ..)

    def introduce(self, info: TokenizerInfo) -> None:
        """Nothing: front end 0 describes the tokenizer."""

    def is_alive(self) -> bool:
        return True

    def join(self, timeout_s: float) -> None:
        """Nothing to wait for: the process is the main process's child."""

    def exit_reason(self) -> str:
        return "the scheduler process exited"

    def follower_exit_reason(self) -> str | None:
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the pipe (the scheduler aborts this front end's requests); the main process
        stops the scheduler."""
        self.conn.close()


SchedulerLink = SchedulerProcess | SchedulerPipe


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
