"""The HTTP front ends: uvicorn serving the app over a TokenizerManager, in the main process and,
with `--api-server-count N`, in N-1 processes more.

The main process binds the port and passes the listening socket to the others, so the kernel
hands each connection to whichever process accepts first. Each front end has its own pipe to the
scheduler process and its own tokenizer, so parsing, tokenizing, detokenizing and streaming
spread over N processes. The main process owns the rest: it starts the scheduler and the other
front ends, and stops the server (exit code 1) when any of them exits unexpectedly. SIGINT and
SIGTERM go to it; it passes SIGTERM on, and each front end finishes its streams gracefully.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp

from replaylm.entrypoints.http_streaming import with_server_send
from replaylm.runtime.errors import one_line_error
from replaylm.server_args import ServerArgs

if TYPE_CHECKING:
    from replaylm.model_executor.engine_config import EngineConfig
    from replaylm.runtime.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# idle keep-alive connections outlive clients' pools (httpx and the OpenAI SDK expire theirs after
# 5 s, aiohttp after 15 s): at uvicorn's default of 5 s, a client reusing a connection just as the
# server closes it loses that request (a ReadError under load)
KEEP_ALIVE_S = 75
GRACEFUL_S = 5  # how long a stopping front end lets its streams finish
LISTEN_BACKLOG = 2048  # uvicorn's default


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything loads so that a port in use is
    told at once; OSError naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as err:
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err


def uvicorn_config(app: ASGIApp, args: ServerArgs) -> uvicorn.Config:
    return uvicorn.Config(
        with_server_send(app),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopping gracefully on SIGTERM (and SIGINT in the main process; a
    second signal forces the exit) without re-raising the signal afterwards, so the process
    can stop what it owns and exit with code 0. It also stops when `manager`'s scheduler is
    gone, or (the main process) when another front end exited, for the process to exit
    non-zero: a server without them can only answer 503."""

    def __init__(
        self,
        config: uvicorn.Config,
        manager: TokenizerManager,
        others: FrontEndProcesses | None = None,
        main: bool = True,
    ) -> None:
        super().__init__(config)
        self.manager = manager
        self.others = others
        self.main = main
        self.signalled = False
        self.stop_reason: str | None = None  # why it stopped when it was not signalled

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signalled = True
        if self.others is not None:
            self.others.terminate()  # they finish their streams beside this one's
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up; its end is the last stage of the start."""
        await super().startup(sockets)
        if not self.should_exit:
            self.manager.startup.mark("HTTP ready")
            if self.main:
                self.manager.startup.log_summary()
            self.manager.prepare_structured_output()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main-loop check, every 0.1 s."""
        if not self.manager.healthy():
            self.stop_reason = self.manager.scheduler_exit_reason()
            return True
        if self.others is not None and (reason := self.others.exit_reason()) is not None:
            self.stop_reason = reason
            return True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Ctrl-C reaches every process of the terminal's group: only the main one acts on it
        sigs = (signal.SIGINT, signal.SIGTERM) if self.main else (signal.SIGTERM,)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclass
class FrontEndProcesses:
    """The front ends past the main process's, by index (1 ..)."""

    procs: dict[int, BaseProcess]
    stopping: bool = False

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        conns: list[Connection],
        sock: socket.socket,
        shared_dir: Path | None,
    ) -> FrontEndProcesses:
        """Spawn a front end for each of `conns` (its pipe to the scheduler), serving `sock`;
        the pipes' ends here are closed, so that a front end's exit closes its pipe."""
        ctx = mp.get_context("spawn")
        procs: dict[int, BaseProcess] = {}
        for index, conn in enumerate(conns, start=1):
            procs[index] = ctx.Process(
                target=run_front_end,
                args=(config, conn, sock, index, shared_dir, time.time()),
                daemon=True,
                name=f"replaylm-http{index}",
            )
            procs[index].start()
            conn.close()
        return cls(procs)

    def exit_reason(self) -> str | None:
        """Which front end exited, and its code; None while all run (or once stopping)."""
        if self.stopping:
            return None
        for index, proc in self.procs.items():
            if not proc.is_alive():
                return f"HTTP front-end process {index} exited (code {proc.exitcode})"
        return None

    def terminate(self) -> None:
        """SIGTERM each: it stops accepting, finishes its streams, and exits."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()

    def stop(self, timeout_s: float = GRACEFUL_S + 5) -> None:
        """Stop them (gracefully, then by SIGKILL past `timeout_s`)."""
        self.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_front_end(
    config: EngineConfig,
    conn: Connection,
    sock: socket.socket,
    index: int,
    shared_dir: Path | None,
    spawned_at: float,
) -> None:
    """A front end's process: wait for the model as the main process does, then serve `sock`
    until SIGTERM (exit 0) or the scheduler's end (exit 1). It fails quietly at start-up (exit
    2): the main process meets the same failure and says why."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = config.args
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [http{index}] %(name)s: %(message)s",
    )
    # the main process's start-up stages tell the start; N copies of them would bury it
    logging.getLogger("replaylm.startup_stages").setLevel(logging.WARNING)
    from replaylm.entrypoints.http_server import create_app
    from replaylm.runtime.scheduler_process import SchedulerPipe
    from replaylm.runtime.tokenizer_manager import TokenizerManager
    from replaylm.startup_stages import StartupStages

    try:
        manager = TokenizerManager(
            config, SchedulerPipe(conn, index), StartupStages(f"http{index}", spawned_at)
        )
    except Exception as err:
        logger.debug("front end %d cannot start: %s", index, one_line_error(err))
        sys.exit(2)
    server = GracefulServer(
        uvicorn_config(create_app(manager, shared_dir), args), manager, main=False
    )
    try:
        server.run(sockets=[sock])
    finally:
        manager.shutdown()
    sys.exit(1 if server.stop_reason is not None and not server.signalled else 0)
