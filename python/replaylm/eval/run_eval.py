"""Run an accuracy eval against an OpenAI-compatible server.

    python -m replaylm.eval.run_eval --eval-name gsm8k --num-examples 200 --dump run.jsonl

Prints accuracy (95% Wilson interval), invalid-answer rate, latency and output throughput.
Exit status: 0 after a run (even with failed requests: they count as invalid and are reported),
1 when the server or the data cannot be used, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replaylm.eval.base import Eval
from replaylm.eval.client import OpenAIClient, ServerError
from replaylm.eval.data import DataError
from replaylm.eval.metrics import summarise
from replaylm.eval.registry import EVAL_NAMES, load_eval
from replaylm.eval.report import format_table, write_dump, write_json
from replaylm.eval.runner import Record, run


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m replaylm.eval.run_eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--eval-name",
        default="gsm8k",
        choices=EVAL_NAMES,
        metavar="NAME",
        help=f"one of: {', '.join(EVAL_NAMES)} (default: gsm8k)",
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:30000/v1",
        help="the API root of the server (default: %(default)s)",
    )
    p.add_argument("--model", help="model id to request (default: the first of GET /models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--data-path",
        help="questions file or http(s)/file:// URL (gsm8k: test.jsonl, "
        "with train.jsonl beside it for the shots; mgsm: the language's .tsv); "
        "default: the copy shipped with replaylm",
    )
    p.add_argument(
        "--num-examples", type=_int_at_least(1), help="ask only the first N (default: all)"
    )
    p.add_argument(
        "--num-shots", type=_int_at_least(0), help="few-shot examples (gsm8k only; default 5)"
    )
    p.add_argument("--max-tokens", type=_int_at_least(1), default=512, help="default: %(default)s")
    p.add_argument(
        "--parallel",
        type=_int_at_least(1),
        default=32,
        help="requests in flight at once (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="picks the shots (default: %(default)s)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds per request before it counts as failed (default: %(default)s)",
    )
    p.add_argument("--json", metavar="PATH", help="write the config and metrics as JSON")
    p.add_argument(
        "--dump",
        metavar="PATH",
        help="write every question's prompt, completion, "
        "parsed answer, reference and verdict as JSON lines",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


async def _evaluate(args: argparse.Namespace, ev: Eval) -> tuple[str, list[Record], float]:
    """(the model asked, the records, the run's wall seconds); ServerError if unreachable."""
    async with OpenAIClient(
        args.base_url, args.api_key, args.request_timeout, args.parallel
    ) as client:
        ids = await client.model_ids()
        model = args.model or (ids[0] if ids else None)
        if model is None:
            raise ServerError(f"{client.base_url}/models lists no model; pass --model")
        records, wall = await run(
            ev,
            ev.examples[: args.num_examples],
            client,
            model,
            args.max_tokens,
            args.parallel,
            not args.no_progress,
        )
        return model, records, wall


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in (args.json, args.dump):
        if path and not Path(path).resolve().parent.is_dir():
            parser.error(f"cannot write {path}: its folder does not exist")
    try:
        ev = load_eval(args.eval_name, args.data_path, args.num_shots, args.seed)
    except ValueError as err:
        parser.error(str(err))
    except DataError as err:
        return _fail(str(err))
    if not ev.examples:
        return _fail(f"{args.eval_name}: the data holds no questions")
    try:
        model, records, wall = asyncio.run(_evaluate(args, ev))
    except ServerError as err:
        return _fail(str(err))
    metrics = summarise(records, wall)
    config: dict[str, Any] = {
        "eval_name": ev.name,
        "model": model,
        "base_url": args.base_url,
        "data_path": args.data_path,
        "num_shots": ev.num_shots,
        "max_tokens": args.max_tokens,
        "parallel": args.parallel,
        "seed": args.seed,
    }
    print(format_table(config, metrics))
    if args.json:
        write_json(args.json, config, metrics)
    if args.dump:
        write_dump(args.dump, records)
    if metrics.errors:
        first = next(r.error for r in records if r.error)
        print(
            f"warning: {metrics.errors} of {metrics.num_examples} requests failed "
            f"(counted as invalid); first error: {first}",
            file=sys.stderr,
        )
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
