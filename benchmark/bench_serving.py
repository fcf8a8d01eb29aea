"""Online serving benchmark against any OpenAI-compatible server (streaming requests).

    python benchmark/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 200 \\
        [--request-rate 4 8 inf] [--max-concurrency 4 32] [--endpoint completions|chat] \\
        [--dataset random | PATH.jsonl | URL] [--json out.json]

Prompts: `random` sends token-id prompts of random length (uniform in
[ratio * --random-input-len, --random-input-len]; /v1/completions only) asking for random output
lengths with `ignore_eos` (a vLLM / SGLang / replaylm extension; `--no-ignore-eos` for strict
OpenAI servers); a dataset file or URL (JSON lines or a JSON list) supplies text prompts from
`--dataset-field` (default: the first of question, prompt, text), each asking for
`--dataset-output-len` tokens. Arrivals are Poisson at each `--request-rate` (req/s; `inf` sends
all at once), optionally capped at `--max-concurrency` requests in flight (several values: a run
for each, under every rate).

Per run (rate x concurrency) it prints a table: request and token throughput, TTFT,
inter-token latency (the gap between streamed chunks that carry text), time per output token and
end-to-end latency (mean / p50 / p90 / p99). `--json` writes `{"config", "summary": [one flat
dict per run], "requests": [...]}`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from common import write_json

DATASET_FIELDS = ("question", "prompt", "text")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestSpec:
    prompt: str | list[int]
    output_len: int
    input_len: int | None  # known for token-id prompts; from the server's usage otherwise


@dataclass
class RequestResult:
    ok: bool
    input_len: int | None = None
    output_len: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---- prompts ------------------------------------------------------------------------------------


def random_specs(args: argparse.Namespace, rng: random.Random) -> list[RequestSpec]:
    def length(full: int) -> int:
        return rng.randint(max(1, int(full * args.random_range_ratio)), full)

    specs = []
    for _ in range(args.num_prompts):
        n = length(args.random_input_len)
        ids = [rng.randrange(*args.random_token_range) for _ in range(n)]
        specs.append(RequestSpec(ids, length(args.random_output_len), n))
    return specs


def dataset_specs(args: argparse.Namespace, rng: random.Random) -> list[RequestSpec]:
    """Text prompts from a JSON-lines / JSON-list file or URL, shuffled, cycled to N."""
    if args.dataset.startswith(("http://", "https://")):
        raw = httpx.get(args.dataset, follow_redirects=True, timeout=60).raise_for_status().text
    else:
        raw = Path(args.dataset).read_text(encoding="utf-8")
    stripped = raw.lstrip()
    rows = (
        json.loads(raw)
        if stripped.startswith("[")
        else [json.loads(line) for line in raw.splitlines() if line.strip()]
    )
    fields = [args.dataset_field] if args.dataset_field else list(DATASET_FIELDS)
    prompts = [next((row[f] for f in fields if isinstance(row.get(f), str)), None) for row in rows]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise SystemExit(f"no rows of {args.dataset} have a text field among {fields}")
    rng.shuffle(prompts)
    return [
        RequestSpec(prompts[i % len(prompts)], args.dataset_output_len, None)
        for i in range(args.num_prompts)
    ]


# ---- one request --------------------------------------------------------------------------------


def payload(args: argparse.Namespace, model: str, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def chunk_text(event: dict[str, Any]) -> str:
    text = ""
    for choice in event.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], spec: RequestSpec
) -> RequestResult:
    """Stream one request; TTFT is the first chunk with text, ITL the gaps between such chunks."""
    res = RequestResult(ok=False, input_len=spec.input_len)
    start = last = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                res.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return res
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    res.error = str(event["error"])
                    return res
                usage = event.get("usage") or usage
                if chunk_text(event):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        res.error = f"{type(err).__name__}: {err}"
        return res
    res.latency = time.perf_counter() - start
    res.output_len = usage["completion_tokens"] if usage else chunks
    if usage:
        res.input_len = usage["prompt_tokens"]
    res.ok = True
    return res


# ---- a run --------------------------------------------------------------------------------------


async def run(
    args: argparse.Namespace,
    model: str,
    specs: list[RequestSpec],
    rate: float,
    concurrency: int | None,
    rng: random.Random,
) -> tuple[list[RequestResult], float]:
    """Send every spec (Poisson arrivals at `rate`, at most `concurrency` in flight when set);
    return the results and the wall time."""
    path = "chat/completions" if args.endpoint == "chat" else "completions"
    url = f"{args.base_url.rstrip('/')}/v1/{path}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(specs) + 1)
    gate = asyncio.Semaphore(concurrency or len(specs))
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        for spec in specs[: args.warmup]:
            await send(client, url, payload(args, model, spec), spec)
        bar = tqdm(
            total=len(specs),
            desc=f"rate {rate}, max concurrency {concurrency}",
            disable=args.disable_tqdm,
        )

        async def one(spec: RequestSpec) -> RequestResult:
            async with gate:
                result = await send(client, url, payload(args, model, spec), spec)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(one(spec)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    arr = np.asarray(values_s) * 1e3
    out: dict[str, float | None] = {f"mean_{name}_ms": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def summarize(
    args: argparse.Namespace,
    model: str,
    rate: float,
    concurrency: int | None,
    results: list[RequestResult],
    duration: float,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    inputs = sum(r.input_len or 0 for r in ok)
    outputs = sum(r.output_len for r in ok)
    tpot = [
        (r.latency - r.ttft) / (r.output_len - 1)
        for r in ok
        if r.ttft is not None and r.output_len > 1
    ]
    shown_rate = rate if math.isfinite(rate) else "inf"
    row = {
        "name": f"serving rate={shown_rate} max_concurrency={concurrency}",
        "model": model,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "request_rate": shown_rate,
        "max_concurrency": concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "input_token_throughput": inputs / duration,
        "output_token_throughput": outputs / duration,
        **_stats("ttft", [r.ttft for r in ok if r.ttft is not None]),
        **_stats("itl", [gap for r in ok for gap in r.itl]),
        **_stats("tpot", tpot),
        **_stats("e2e", [r.latency for r in ok]),
    }
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def print_table(row: dict[str, Any]) -> None:
    print(f"\n{' serving benchmark ':=^60}")
    for key, value in row.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<40}{shown:>20}")
    print("=" * 60)


async def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        response = await client.get(f"{args.base_url.rstrip('/')}/v1/models")
        return response.raise_for_status().json()["data"][0]["id"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--dataset", default="random", help="random, or a JSON(L) file or URL")
    parser.add_argument("--dataset-field", default=None)
    parser.add_argument("--dataset-output-len", type=int, default=128)
    parser.add_argument("--random-input-len", type=int, default=512)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.5)
    parser.add_argument(
        "--random-token-range",
        type=int,
        nargs=2,
        default=(100, 20000),
        help="token ids of random prompts are drawn from [LOW, HIGH)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests per second (Poisson); inf = all at once",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=[None],
        help="requests in flight at most (several: a run for each)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests before each run")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.dataset == "random" and args.endpoint == "chat":
        parser.error("--dataset random sends token-id prompts: use --endpoint completions")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    specs = random_specs(args, rng) if args.dataset == "random" else dataset_specs(args, rng)
    model = asyncio.run(resolve_model(args))
    summary, requests = [], []
    for rate, concurrency in itertools.product(args.request_rate, args.max_concurrency):
        results, duration = asyncio.run(run(args, model, specs, rate, concurrency, rng))
        row = summarize(args, model, rate, concurrency, results, duration)
        print_table(row)
        errors = [r.error for r in results if not r.ok]
        if errors:
            print(f"{len(errors)} requests failed; the first: {errors[0]}")
        summary.append(row)
        requests += [
            {"request_rate": row["request_rate"], "max_concurrency": concurrency, **asdict(r)}
            for r in results
        ]
    if args.json:
        config = {
            **vars(args),
            "json": str(args.json),
            "request_rate": [str(r) for r in args.request_rate],
        }
        write_json(args.json, {"config": config, "summary": summary, "requests": requests})


if __name__ == "__main__":
    main()
