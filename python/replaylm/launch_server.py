"""Start the server: `python -m replaylm.launch_server [flags]` (`--help` lists every flag).

With no flags it serves the built-in SmolLM2-135M-Instruct on http://127.0.0.1:30000 (GPU when
there is one, else CPU). The model loads in a child process (progress bar on stderr); the URL is
logged once it is ready. SIGINT/SIGTERM stop the HTTP server, then the scheduler process.

Exit codes: 0 after SIGINT/SIGTERM; 2 when the server cannot start (bad flags, a missing model
path, a model that fails to load: one line on stderr says why); 1 when the scheduler process dies
while serving (the log says why), so that a supervisor restarts the server. The API key may be
given in the REPLAYLM_API_KEY environment variable instead of --api-key.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from multiprocessing.connection import wait
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from replaylm.entrypoints.api_servers import (
    FrontEndProcesses,
    GracefulServer,
    listening_socket,
    uvicorn_config,
)
from replaylm.model_executor.engine_config import EngineConfig, resolve_engine_config
from replaylm.runtime.errors import one_line_error
from replaylm.runtime.scheduler_process import (
    SchedulerProcess,
    spawn_followers,
    stop_processes,
)
from replaylm.server_args import ServerArgs
from replaylm.startup_stages import StartupStages

if TYPE_CHECKING:
    from replaylm.runtime.tokenizer_manager import TokenizerManager

logger = logging.getLogger("replaylm.launch_server")
API_KEY_ENV = "REPLAYLM_API_KEY"
EXIT_CANNOT_START = 2
EXIT_SCHEDULER_DIED = 1
# prometheus_client's multiprocess mode, for several front ends: their values in files of this
# folder, each scrape summing them. Read when prometheus_client is imported.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _http_stack() -> str:
    """What uvicorn's `auto` loop and parser are: uvloop and httptools where installed (about
    a fifth less CPU per streamed token than asyncio and h11)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    parser = "httptools" if importlib.util.find_spec("httptools") else "h11"
    stack = f"{loop} event loop, {parser} HTTP parser"
    if (loop, parser) != ("uvloop", "httptools"):
        stack += "; uvloop and httptools would cost less CPU per streamed token"
    return stack


def _usage_error(message: str) -> NoReturn:
    """The server cannot start: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_CANNOT_START)


def parse_args(argv: list[str] | None = None) -> tuple[ServerArgs, bool]:
    """(server args, whether to only print the CUDA-graph config), their values and paths
    checked; `resolve_engine_config` resolves them for this machine."""
    parser = argparse.ArgumentParser(
        prog="python -m replaylm.launch_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ServerArgs.add_cli_args(parser)
    parser.add_argument(
        "--print-cuda-graph-config",
        action="store_true",
        help="Print the CUDA-graph mode and capture shapes each phase resolves to, as JSON, and "
        "exit without loading a model; with --device cuda it shows a GPU's on any machine.",
    )
    ns = parser.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    try:
        args.validate()
        if not ns.print_cuda_graph_config:
            args.check_paths()
    except (ValueError, FileNotFoundError) as err:
        _usage_error(str(err))
    return args, ns.print_cuda_graph_config


def main(argv: list[str] | None = None) -> int:
    """Start-up runs in parallel: the scheduler process starts loading the model first, while
    this process (and any other front end) loads the tokenizer. This process resolves the
    settings for the machine once (the GPUs probed through the driver: torch is the scheduler's
    to import) and hands them to the scheduler. Each stage of the start is logged as it ends
    (`startup stage ...`)."""
    stages = StartupStages.from_process_start("http")
    args, print_only = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = _resolve_or_exit(args)  # a bad combination fails here, before anything starts
    if print_only:
        for warning in config.cuda_graphs.warnings:
            logger.warning("%s", warning)
        print(json.dumps(config.cuda_graphs.to_dict()))
        return 0
    config.log()
    if args.node_rank > 0:
        return serve_other_node(config)
    stages.mark("imports and arguments")
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as err:
        _usage_error(str(err))
    with tempfile.TemporaryDirectory(prefix="replaylm-") as shared:
        if config.api_server_count > 1:  # before prometheus_client is imported, here and there
            os.environ[METRICS_DIR_ENV] = shared
        return _serve(config, sock, Path(shared), stages)


def _serve(
    config: EngineConfig, sock: socket.socket, shared_dir: Path, stages: StartupStages
) -> int:
    """Start the scheduler and the front ends, serve until a signal (0) or until the scheduler
    or a front end exits (1). Several front ends share `shared_dir` (their stored responses)."""
    args = config.args
    shared = shared_dir if config.api_server_count > 1 else None
    # until uvicorn's handlers take over, SIGTERM stops the start as Ctrl-C does: another front
    # end may already answer, so a supervisor's SIGTERM can come before this one serves
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    scheduler = SchedulerProcess.start(config, config.api_server_count)
    others: FrontEndProcesses | None = None
    manager: TokenizerManager | None = None
    server: GracefulServer | None = None
    try:
        stages.mark("spawn scheduler")
        logger.info("server args: %s", config.args)
        from replaylm.entrypoints.http_server import RESPONSES_DB, create_app
        from replaylm.entrypoints.responses_store import SharedResponseStore
        from replaylm.runtime.tokenizer_manager import TokenizerManager

        if shared is not None:  # before the front ends start: they would race for its schema
            SharedResponseStore.create(shared / RESPONSES_DB)
        others = FrontEndProcesses.start(config, scheduler.front_end_conns, sock, shared)
        stages.mark("front-end imports")
        try:
            manager = TokenizerManager(config, scheduler, stages)
        except Exception as err:  # the tokenizer or the model failed to load
            logger.debug("start-up failed", exc_info=True)
            _usage_error(one_line_error(err))
        server = GracefulServer(uvicorn_config(create_app(manager, shared), args), manager, others)
        stages.mark("HTTP app")
        logger.info(
            "serving %s at http://%s:%d (OpenAI API under /v1; %s; %d HTTP front-end %s)",
            manager.served_model_name,
            args.host,
            args.port,
            _http_stack(),
            config.api_server_count,
            "process" if config.api_server_count == 1 else "processes",
        )
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        logger.info("stopped by a signal before serving")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below is already bounded
        if others is not None:
            others.stop()
        if manager is not None:
            manager.shutdown()  # the scheduler's end is then not an error
        else:
            scheduler.stop()
    assert server is not None  # server.run returned
    if server.stop_reason is not None and not server.signalled:
        logger.error(
            "stopping the server (exit code %d): %s", EXIT_SCHEDULER_DIED, server.stop_reason
        )
        return EXIT_SCHEDULER_DIED
    return 0


def serve_other_node(config: EngineConfig) -> int:
    """`--node-rank` above 0: run this node's tensor-parallel ranks, which follow rank 0 on
    node 0 (no HTTP here). The exit code: 0 once they all ended after rank 0's shutdown (or on
    SIGINT/SIGTERM), 1 when one failed (the others are stopped; the log says which and why)."""
    args = config.args
    first = args.node_rank * args.ranks_per_node
    logger.info(
        "node %d of %d: tensor-parallel ranks %d-%d of %d, meeting at %s",
        args.node_rank,
        args.nnodes,
        first,
        first + args.ranks_per_node - 1,
        args.tp_size,
        args.dist_init_addr,
    )
    procs = spawn_followers(config, range(args.ranks_per_node))
    signalled = False

    def on_signal(sig: int, frame: FrameType | None) -> None:
        nonlocal signalled
        signalled = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    running = dict(procs)
    while running and not signalled:
        wait([p.sentinel for p in running.values()], timeout=0.5)
        for rank, proc in list(running.items()):
            if proc.is_alive():
                continue
            del running[rank]
            if proc.exitcode != 0:
                stop_processes(list(running.values()), timeout_s=5)
                logger.error(
                    "stopping node %d (exit code %d): the scheduler process of tensor-parallel "
                    "rank %d exited (code %s)",
                    args.node_rank,
                    EXIT_SCHEDULER_DIED,
                    rank,
                    proc.exitcode,
                )
                return EXIT_SCHEDULER_DIED
    stop_processes(list(running.values()), timeout_s=5)
    return 0


def _resolve_or_exit(args: ServerArgs) -> EngineConfig:
    """resolve_engine_config, or a usage error."""
    try:
        return resolve_engine_config(args)
    except ValueError as err:
        _usage_error(str(err))


if __name__ == "__main__":
    sys.exit(main())
