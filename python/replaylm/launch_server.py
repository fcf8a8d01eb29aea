"""Start the server: `python -m replaylm.launch_server [flags]` (`--help` lists every flag).

With no flags it serves the built-in SmolLM2-135M-Instruct on http://127.0.0.1:30000 (GPU when
there is one, else CPU). The model loads in a child process (progress bar on stderr); the URL is
logged once it is ready. SIGINT/SIGTERM stop the HTTP server, then the scheduler process.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from replaylm.entrypoints.http_server import create_app
from replaylm.runtime.tokenizer_manager import TokenizerManager
from replaylm.server_args import ServerArgs

logger = logging.getLogger("replaylm.launch_server")


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m replaylm.launch_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    try:
        args.validate()
    except ValueError as err:
        parser.error(str(err))  # one line, exit code 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("server args: %s", args)
    try:
        manager = TokenizerManager(args)
    except (RuntimeError, FileNotFoundError, ValueError) as err:
        logger.error("%s", err)
        return 1
    try:
        app = create_app(manager)
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        logger.info("serving %s at http://%s:%d (OpenAI API under /v1)",
                    manager.served_model_name, args.host, args.port)
        server.run()
    finally:
        manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
