"""Start the server: `python -m replaylm.launch_server [flags]` (`--help` lists every flag).

With no flags it serves the built-in SmolLM2-135M-Instruct on http://127.0.0.1:30000 (GPU when
there is one, else CPU). The model loads in a child process (progress bar on stderr); the URL is
logged once it is ready. SIGINT/SIGTERM stop the HTTP server, then the scheduler process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn

import uvicorn

from replaylm.layers.attention.registry import check_deterministic
from replaylm.layers.attention.selection import resolve_attention_backend
from replaylm.model_executor.cuda_graph.config import (
    CudaGraphConfig,
    check_cuda_graph_args,
    resolve_cuda_graph_config,
)
from replaylm.runtime.scheduler_process import SchedulerProcess
from replaylm.server_args import ServerArgs

logger = logging.getLogger("replaylm.launch_server")


def _usage_error(message: str) -> NoReturn:
    """A bad command line: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> tuple[ServerArgs, bool]:
    """(server args, whether to only print the CUDA-graph config). Checks what needs no device
    (and so no torch); `resolve_for_device` checks the rest."""
    parser = argparse.ArgumentParser(
        prog="python -m replaylm.launch_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ServerArgs.add_cli_args(parser)
    parser.add_argument(
        "--print-cuda-graph-config",
        action="store_true",
        help="print the resolved per-phase CUDA-graph config as JSON and exit "
        "(no model is loaded; use --device to resolve for another device)",
    )
    ns = parser.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)
    try:
        args.validate()
        check_cuda_graph_args(args)
    except ValueError as err:
        _usage_error(str(err))
    return args, ns.print_cuda_graph_config


def resolve_for_device(args: ServerArgs) -> CudaGraphConfig:
    """The CUDA-graph config for the device the model will load on, after the checks that
    depend on it; ValueError with a one-line message for a bad combination."""
    device = _graph_device(args.device)
    graphs = resolve_cuda_graph_config(args, device)
    if args.deterministic:
        check_deterministic(resolve_attention_backend(args.attention_backend, device))
    if args.enable_pdl and device != "cuda":  # a GPU's capability: where the model loads
        import torch

        from replaylm.layers.kernels import check_pdl

        check_pdl(True, torch.device(device))
    return graphs


def _graph_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # only here: --print-cuda-graph-config with an explicit device needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def log_cuda_graph_config(graphs: CudaGraphConfig) -> None:
    for warning in graphs.warnings:
        logger.warning("%s", warning)
    for note in graphs.notes:
        logger.info("%s", note)
    logger.info(
        "CUDA graphs: %s (decode from %s, prefill from %s)",
        graphs.summary(),
        graphs.decode.source,
        graphs.prefill.source,
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopping gracefully on SIGINT/SIGTERM (a second one forces the exit)
    without re-raising the signal afterwards, so launch_server can stop the scheduler process
    and exit with code 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Start-up runs in parallel: the scheduler process starts loading the model first, while
    this process resolves the device-dependent config (importing torch) and loads the tokenizer
    (importing transformers); each takes seconds."""
    args, print_only = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if print_only:
        graphs = _resolve_or_exit(args)
        for warning in graphs.warnings:
            logger.warning("%s", warning)
        print(json.dumps(graphs.to_dict()))
        return 0
    scheduler = SchedulerProcess.start(args)
    graphs = _resolve_or_exit(args, scheduler)
    logger.info("server args: %s", args)
    log_cuda_graph_config(graphs)
    from replaylm.entrypoints.http_server import create_app
    from replaylm.runtime.tokenizer_manager import TokenizerManager

    try:
        manager = TokenizerManager(args, graphs, scheduler)
    except (RuntimeError, FileNotFoundError, ValueError) as err:
        logger.error("%s", err)
        return 1
    try:
        app = create_app(manager)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
        server = GracefulServer(config)
        logger.info(
            "serving %s at http://%s:%d (OpenAI API under /v1)",
            manager.served_model_name,
            args.host,
            args.port,
        )
        server.run()
    finally:
        manager.shutdown()
    return 0


def _resolve_or_exit(
    args: ServerArgs, scheduler: SchedulerProcess | None = None
) -> CudaGraphConfig:
    """resolve_for_device, or a usage error (after stopping `scheduler`, when one started)."""
    try:
        return resolve_for_device(args)
    except ValueError as err:
        if scheduler is not None:
            scheduler.stop(timeout_s=0)
        _usage_error(str(err))


if __name__ == "__main__":
    sys.exit(main())
