"""Generate text from the command line with the offline Engine.

    python -m replaylm.generate "What is the capital of France?"
    python -m replaylm.generate --raw --max-new-tokens 32 "The capital of France is"

Prompts go through the model's chat template unless `--raw` is given. Every ServerArgs flag
(`--model-path`, `--device`, `--dtype`, ...) is accepted; the default model is the built-in one.
"""

from __future__ import annotations

import argparse
import logging
import sys

from replaylm.entrypoints.engine import Engine
from replaylm.server_args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m replaylm.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompts", nargs="+", help="one or more prompts, generated as one batch")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None)
    ServerArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.sampling_seed,
    }
    try:
        engine = Engine(**vars(server_args))
        if args.raw:
            outs = engine.generate(args.prompts, params)
        else:
            ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in args.prompts]
            outs = engine.generate(input_ids=ids, sampling_params=params)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outs, strict=True):
        print(f">>> {prompt}\n{out['text']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
