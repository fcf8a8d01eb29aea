"""Generate text from the command line with the offline Engine.

    python -m replaylm.generate "What is the capital of France?"
    python -m replaylm.generate --raw --max-new-tokens 32 "The capital of France is"

Prompts go through the model's chat template unless `--raw` is given. Every engine flag of the
server (`--model-path`, `--device`, `--dtype`, ...) is accepted, not its HTTP flags; the default
model is the built-in one. A bad flag or model prints one line and exits with code 2.
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
    parser.add_argument("prompts", nargs="+", help="One or more prompts, generated as one batch.")
    parser.add_argument(
        "--raw",
        action="store_true",
        help="Send the prompts as they are, without the chat template (for base models or "
        "text completion).",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="Most tokens to generate per prompt."
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="Sampling temperature; 0 always picks the most likely token (greedy).",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="Sample from the smallest set of tokens whose probabilities add up to this.",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="Sample from the k most likely tokens only; -1 for no limit.",
    )
    parser.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="Seed of every prompt's sampling. Default: one drawn per prompt from --seed.",
    )
    ServerArgs.add_cli_args(parser, server=False)
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
        server_args.check_paths()
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
