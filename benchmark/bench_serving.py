"""Online serving benchmark against any OpenAI-compatible server (streaming requests).

    python benchmark/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 200 \\
        [--request-rate 4 8 inf] [--rate-seconds 15] [--max-concurrency 4 32] \\
        [--random-dist uniform|lognormal] [--random-sigma 1.0] \\
        [--endpoint completions|chat|generate] \\
        [--workload plain json_schema shared_prefix multi_turn] \\
        [--dataset random | PATH.jsonl | URL] [--json out.json]

Prompts: `random` sends prompts of random token ids (/v1/completions or /generate) asking for
random output lengths with `ignore_eos` (a vLLM / SGLang / replaylm extension; `--no-ignore-eos`
for strict OpenAI servers). Their lengths, drawn apart for the prompt and the output, follow
`--random-dist`:
  uniform    an integer uniform in [--random-range-ratio * LEN, LEN], LEN the flag's length (as
             SGLang's bench_serving draws them; vLLM's draws around LEN, in [LEN * (1 - r),
             LEN * (1 + r)]). No tail: every request is about as long as the next.
  lognormal  a long tail, like real chat traffic's (vLLM and SGLang get one only from dataset
             files such as ShareGPT): ln(length) ~ Normal(ln LEN, --random-sigma), rounded and
             clipped to [1, --random-max-input-len / --random-max-output-len (default 8 * LEN)].
             LEN is the median; the mean is LEN * exp(sigma^2 / 2) before clipping (1.65 * LEN
             at sigma 1, whose 99th percentile is 10 * LEN).
Each run draws random prompts of its own, and warms up on others, so that a server's prefix cache
holds none of them from an earlier run. A dataset file or URL (JSON lines or a JSON list) supplies
text prompts from `--dataset-field` (default: the first of question, prompt, text), each asking
for `--dataset-output-len` tokens; every run sends the same ones, the first `--warmup` of them
also before it.

Arrivals are Poisson at each `--request-rate` (req/s; `inf` sends all at once), optionally capped
at `--max-concurrency` requests in flight (several values: a run for each, under every rate).
A run sends `--num-prompts` requests; with `--rate-seconds S` a run at a finite rate R sends
round(R * S) instead (at least 100, for its percentiles), so that its arrivals last about S
seconds at every rate of a sweep.
`--endpoint generate` sends them to the native `POST /generate` (replaylm, SGLang) with
`sampling_params`.

The client is aiohttp, one client per run. Its CPU time per streamed token (tens of
microseconds) still caps the throughput one client process can measure: `--client-processes K`
splits each run over K processes. Request i goes to process i mod K (multi_turn: conversation
i, whole); each sends its requests at rate / K (their sum is Poisson at the rate), at most
C / K in flight under `--max-concurrency C` (rounded, adding up to C; C >= K), from a common
start on the wall clock. This process sends the warm-up and merges their results: the run's
time is from the common start to the last request's end, TTFT, ITL and latencies each
process's own measurements.

Workloads (`--workload`, several: a run of each): `plain` sampling, and `json_schema`,
structured output where every request asks for the same JSON schema (`--json-schema PATH`, default
a small record schema): in `sampling_params.json_schema` on `/generate`, as an OpenAI
`response_format` on the OpenAI routes. Its prompts ask for the JSON, as vLLM's structured-output
benchmark's do: text naming the schema's fields and quoting the schema, each for a person of its
own (an index and a random occupation), asking for the output length of the plain prompt of the
same index; a model left to random prompts pads the JSON with whitespace until the length runs
out. On replaylm EOS still ends a structured request once its JSON is complete (the grammar allows
nothing else), so its outputs are shorter than asked: compare token throughput. Its rows count the
outputs that parse as JSON and, from the server's `/metrics` where it has them (replaylm), the
grammar engine's host time per step.

Two workloads measure a prefix cache, each run on token-id prompts of its own, drawn afresh
(`--random-token-range`), and warmed up on others: `shared_prefix`, `--num-prompts` prompts of one
shared `--prefix-len`-token prefix and `--suffix-len` tokens of each one's own; `multi_turn`,
`--num-prompts` conversations of `--turns` turns, turn 0 a `--user-len`-token user message and turn
t's prompt turn t-1's prompt, the token ids answered to it and a new user message (`--endpoint
generate`, whose events carry the ids; a failed request ends its conversation). A turn's requests
are sent (at the run's rate and concurrency) once the previous turn has finished. Both ask for
`--random-output-len` tokens per request.

Per run (workload x rate x concurrency) it prints a table: request and token throughput, TTFT,
inter-token latency (the gap between streamed chunks that carry text), time per output token and
end-to-end latency (mean / p50 / p90 / p99), and the prompt tokens the server reports cached
(`usage.prompt_tokens_details.cached_tokens`; `meta_info.cached_tokens` on `/generate`) with the
hit rate (cached over the prompt tokens of the requests that report it; None where none does),
and the server's tensor-parallel size where its `/get_server_info` reports one (replaylm's and
SGLang's do). At the end, one line per run: TP, rate, concurrency, req/s, output tok/s, TTFT p50
/ p99, ITL p50 / p99 and TPOT p50. `--json` writes `{"config", "summary": [one flat dict per
run]}`; the config holds every flag, the length distribution's included. `--json-requests`
adds `"requests"`: one record per request (timings, lengths, errors).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import random
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from common import next_turn_prompts, shared_prefix_prompts, write_json

DATASET_FIELDS = ("question", "prompt", "text")
PERCENTILES = (50, 90, 99)
LENGTH_DISTS = ("uniform", "lognormal")
MIN_RATE_PROMPTS = 100  # --rate-seconds: enough requests at a low rate for its percentiles
START_DELAY_S = 1.0  # --client-processes: a run's common start, this far ahead of its shares
LATE_START_S = 0.1  # a client process that starts its share later than this warns of it
POOL_START_TIMEOUT_S = 300.0  # for the client processes to start (import this script)
ROUTES = {"chat": "v1/chat/completions", "completions": "v1/completions", "generate": "generate"}
SWEEP_COLUMNS = (  # the closing table: (summary key, heading)
    ("tp_size", "TP"),
    ("workload", "workload"),
    ("request_rate", "rate"),
    ("max_concurrency", "max conc"),
    ("completed", "done"),
    ("failed", "failed"),
    ("request_throughput", "req/s"),
    ("output_token_throughput", "out tok/s"),
    ("p50_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("p50_itl_ms", "ITL p50"),
    ("p99_itl_ms", "ITL p99"),
    ("p50_tpot_ms", "TPOT p50"),
)
WORKLOADS = ("plain", "json_schema", "shared_prefix", "multi_turn")
PREFIX_WORKLOADS = ("shared_prefix", "multi_turn")  # token-id prompts of their own per run
RECORD_SCHEMA = {  # the default structured-output workload: a short record
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
GRAMMAR_METRICS = ("replaylm_grammar_steps", "replaylm_grammar_host_seconds")
OCCUPATIONS = (  # the json_schema workload's prompts: one at random per person
    "baker", "pilot", "teacher", "gardener", "chemist", "violinist", "nurse", "farmer",
    "architect", "librarian", "sailor", "painter", "plumber", "surgeon", "journalist", "tailor",
)  # fmt: skip


@dataclass
class RequestSpec:
    prompt: str | list[int]
    output_len: int
    input_len: int | None  # known for token-id prompts; from the server's usage otherwise
    conversation: int = 0  # multi_turn: which conversation the request continues


@dataclass
class RequestResult:
    ok: bool
    input_len: int | None = None
    output_len: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    valid_json: bool | None = None  # structured output: whether the whole text parses
    cached_len: int | None = None  # prompt tokens the server reports cached (None: not reported)
    output_ids: list[int] = field(default_factory=list)  # on /generate, which streams them


# ---- prompts ------------------------------------------------------------------------------------


def random_length(args: argparse.Namespace, rng: random.Random, length: int, longest: int) -> int:
    """A prompt or output length of `--random-dist` around `length`: uniform up to it, or
    lognormal with it as the median, clipped to [1, `longest`]."""
    if args.random_dist == "lognormal":
        drawn = round(rng.lognormvariate(math.log(length), args.random_sigma))
        return min(max(1, drawn), longest)
    return rng.randint(max(1, int(length * args.random_range_ratio)), length)


def random_specs(args: argparse.Namespace, rng: random.Random, num: int) -> list[RequestSpec]:
    """`num` prompts of random token ids, their prompt and output lengths of `--random-dist`."""
    specs = []
    for _ in range(num):
        n = random_length(args, rng, args.random_input_len, args.random_max_input_len)
        ids = [rng.randrange(*args.random_token_range) for _ in range(n)]
        out = random_length(args, rng, args.random_output_len, args.random_max_output_len)
        specs.append(RequestSpec(ids, out, n))
    return specs


def run_prompts(args: argparse.Namespace, rate: float) -> int:
    """How many requests (conversations, for multi_turn) a run at `rate` sends."""
    if args.rate_seconds is None or not math.isfinite(rate):
        return args.num_prompts
    return max(MIN_RATE_PROMPTS, round(rate * args.rate_seconds))


def dataset_specs(args: argparse.Namespace, rng: random.Random, num: int) -> list[RequestSpec]:
    """Text prompts from a JSON-lines / JSON-list file or URL, shuffled, cycled to `num`."""
    if args.dataset.startswith(("http://", "https://")):
        with urllib.request.urlopen(args.dataset, timeout=60) as response:
            raw = response.read().decode("utf-8")
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
        RequestSpec(prompts[i % len(prompts)], args.dataset_output_len, None) for i in range(num)
    ]


def json_schema_prompt(schema: dict[str, Any], index: int, occupation: str) -> str:
    """An instruction to write person `index`'s record as JSON: the schema's fields, the schema,
    and a cue for the answer."""
    fields = ", ".join(schema.get("properties") or {})
    named = f" with the fields {fields}" if fields else ""
    return (
        f"Generate an example profile of person {index}, a {occupation}, as one JSON object"
        f"{named}, following this JSON schema: {json.dumps(schema)}\nJSON:"
    )


def json_schema_specs(
    specs: list[RequestSpec], schema: dict[str, Any], rng: random.Random
) -> list[RequestSpec]:
    """The json_schema workload's requests: one instruction per request of `specs`, asking for
    its output length."""
    return [
        RequestSpec(json_schema_prompt(schema, i, rng.choice(OCCUPATIONS)), s.output_len, None)
        for i, s in enumerate(specs)
    ]


def token_drawer(args: argparse.Namespace, rng: random.Random) -> Callable[[int], list[int]]:
    """`draw(n)`: `n` random token ids from `--random-token-range`."""
    return lambda n: [rng.randrange(*args.random_token_range) for _ in range(n)]


@dataclass
class RunPlan:
    """What one run sends: `warmup` (untimed, one request at a time), then `first`; with
    `follow_ups` (multi_turn), one more turn per entry, the user message of each conversation,
    built from the previous turn's answers."""

    warmup: list[RequestSpec]
    first: list[RequestSpec]
    follow_ups: list[list[list[int]]] = field(default_factory=list)


def prefix_plan(args: argparse.Namespace, workload: str, rng: random.Random, num: int) -> RunPlan:
    """A run of a prefix-cache workload of `num` requests (conversations), on prompts drawn
    afresh."""
    draw, out = token_drawer(args, rng), args.random_output_len

    def specs(prompts: list[list[int]]) -> list[RequestSpec]:
        return [RequestSpec(p, out, len(p), conversation=i) for i, p in enumerate(prompts)]

    if workload == "shared_prefix":
        warmup, first = (
            shared_prefix_prompts(draw, n, args.prefix_len, args.suffix_len)
            for n in (args.warmup, num)
        )
        return RunPlan(specs(warmup), specs(first))
    warmup = [draw(args.user_len) for _ in range(args.warmup)]
    turns = [[draw(args.user_len) for _ in range(num)] for _ in range(args.turns)]
    return RunPlan(specs(warmup), specs(turns[0]), turns[1:])


def run_plan(
    args: argparse.Namespace,
    workload: str,
    rng: random.Random,
    num: int,
    fixed: list[RequestSpec],
) -> RunPlan:
    """A run of `num` requests (conversations): random prompts drawn afresh (the prefix-cache
    workloads', plain's), warmed up on others; otherwise the first of the `fixed` ones that every
    run sends (a dataset's, json_schema's), warmed up on their first `--warmup`."""
    if workload in PREFIX_WORKLOADS:
        return prefix_plan(args, workload, rng, num)
    if workload == "plain" and args.dataset == "random":
        warmup, first = (random_specs(args, rng, n) for n in (args.warmup, num))
        return RunPlan(warmup, first)
    return RunPlan(fixed[: args.warmup], fixed[:num])


def next_turn(
    specs: list[RequestSpec], results: list[RequestResult], messages: list[list[int]]
) -> list[RequestSpec]:
    """The next turn of the conversations whose request in `specs` succeeded: each prompt, the
    ids answered to it and its conversation's user message in `messages`."""
    done = [(s, r) for s, r in zip(specs, results, strict=True) if r.ok]
    prompts = next_turn_prompts(
        [list(s.prompt) for s, _ in done],
        [r.output_ids for _, r in done],
        [messages[s.conversation] for s, _ in done],
    )
    return [
        RequestSpec(p, s.output_len, len(p), s.conversation)
        for p, (s, _) in zip(prompts, done, strict=True)
    ]


# ---- one request --------------------------------------------------------------------------------


def payload(
    args: argparse.Namespace, model: str, spec: RequestSpec, schema: dict[str, Any] | None
) -> dict[str, Any]:
    """The request body; `schema`: the JSON schema its output must follow (None: plain)."""
    if args.endpoint == "generate":
        params: dict[str, Any] = {
            "max_new_tokens": spec.output_len,
            "temperature": args.temperature,
        }
        if args.ignore_eos:
            params["ignore_eos"] = True
        if schema is not None:
            params["json_schema"] = json.dumps(schema)
        prompt_key = "input_ids" if isinstance(spec.prompt, list) else "text"
        return {prompt_key: spec.prompt, "sampling_params": params, "stream": True}
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
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": schema, "strict": True},
        }
    return body


def chunk_text(event: dict[str, Any]) -> str:
    if "choices" not in event:  # native /generate: the text new since the last event
        return event.get("text") or ""
    text = ""
    for choice in event.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def chunk_usage(event: dict[str, Any]) -> dict[str, Any] | None:
    """The token counts an event carries (OpenAI `usage`; native `meta_info`, cumulative)."""
    return event.get("usage") or event.get("meta_info")


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """The prompt tokens a usage reports cached: OpenAI's `prompt_tokens_details.cached_tokens`,
    native `meta_info.cached_tokens`; None when it reports none."""
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens", usage.get("cached_tokens"))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def base_url(args: argparse.Namespace) -> str:
    return args.base_url.rstrip("/")


def open_client(
    args: argparse.Namespace, connections: int, timeout: float | None = None
) -> aiohttp.ClientSession:
    """A client of at most `connections` keep-alive connections, sending the API key; each
    request given `timeout` seconds in all (default `--timeout`). Opened in a running loop."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=args.timeout if timeout is None else timeout),
        headers=headers,
    )


async def send(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    spec: RequestSpec,
    structured: bool,
) -> RequestResult:
    """Stream one request; TTFT is the first chunk with text, ITL the gaps between such chunks.
    `structured`: check that the whole text parses as JSON. Any failure is the result's error."""
    res = RequestResult(ok=False, input_len=spec.input_len)
    start = last = time.perf_counter()
    chunks, usage, texts = 0, None, []
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                res.error = f"HTTP {response.status}: {(await response.read())[:300]!r}"
                return res
            async for line in response.content:  # SSE: `data: {...}` lines, blank ones between
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :].strip()
                if data == b"[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"])
                    return res
                usage = chunk_usage(event) or usage
                res.output_ids += event.get("output_ids") or []
                if text := chunk_text(event):
                    texts.append(text)
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
        res.error = f"{type(err).__name__}: {err}"
        return res
    res.latency = time.perf_counter() - start
    res.output_len = usage["completion_tokens"] if usage else chunks
    if usage:
        res.input_len = usage["prompt_tokens"]
        res.cached_len = cached_tokens(usage)
    if structured:
        res.valid_json = _parses("".join(texts))
    res.ok = True
    return res


async def warm_up(
    client: aiohttp.ClientSession,
    args: argparse.Namespace,
    model: str,
    specs: list[RequestSpec],
    schema: dict[str, Any] | None,
) -> None:
    """Send `specs` one at a time, untimed."""
    url = f"{base_url(args)}/{ROUTES[args.endpoint]}"
    for spec in specs:
        await send(client, url, payload(args, model, spec, schema), spec, schema is not None)


async def grammar_counters(client: aiohttp.ClientSession, base: str) -> tuple[float, float] | None:
    """(steps, host seconds) of the server's grammar engine so far; None when its /metrics
    has no such series (another server)."""
    try:
        async with client.get(f"{base}/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GRAMMAR_METRICS:
            values[name] = float(value)
    if len(values) < len(GRAMMAR_METRICS):
        return None
    steps, seconds = (values[n] for n in GRAMMAR_METRICS)
    return steps, seconds


# ---- a run --------------------------------------------------------------------------------------


@dataclass
class RunResult:
    results: list[RequestResult]
    duration: float
    grammar_steps: float | None = None  # the grammar engine's steps during the run
    grammar_host_s: float | None = None  # and its host time


Turn = list[tuple[int, RequestResult]]  # a turn's results, each with its request's conversation


async def send_turns(
    client: aiohttp.ClientSession,
    args: argparse.Namespace,
    model: str,
    plan: RunPlan,
    rate: float,
    concurrency: int | None,
    rng: random.Random,
    schema: dict[str, Any] | None,
    on_done: Callable[[], object],
) -> list[Turn]:
    """Send the plan's requests (not its warm-up), a turn once the previous one has finished:
    Poisson arrivals at `rate`, at most `concurrency` in flight when set, asking for `schema`
    when given; `on_done()` after each request."""
    url = f"{base_url(args)}/{ROUTES[args.endpoint]}"
    gate = asyncio.Semaphore(concurrency or len(plan.first))

    async def one(spec: RequestSpec) -> RequestResult:
        async with gate:
            body = payload(args, model, spec, schema)
            result = await send(client, url, body, spec, schema is not None)
        on_done()
        return result

    async def turn(specs: list[RequestSpec]) -> Turn:
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(one(spec)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return [(s.conversation, r) for s, r in zip(specs, results, strict=True)]

    specs = plan.first
    turns = [await turn(specs)]
    for messages in plan.follow_ups:
        specs = next_turn(specs, [r for _, r in turns[-1]], messages)
        turns.append(await turn(specs))
    return turns


def merge_turns(parts: list[list[Turn]]) -> list[RequestResult]:
    """The results of every client process's turns in one list, turn by turn, each turn's in
    the order of its conversations (a stable sort: one process's stay in its order)."""
    return [
        result
        for turn in zip(*parts, strict=True)
        for _, result in sorted(itertools.chain(*turn), key=lambda pair: pair[0])
    ]


def run_result(
    results: list[RequestResult],
    duration: float,
    before: tuple[float, float] | None,
    after: tuple[float, float] | None,
) -> RunResult:
    """The run's result, the grammar engine's work read from its counters `before` and
    `after` the run (None where the server has none)."""
    out = RunResult(results, duration)
    if before is not None and after is not None:
        out.grammar_steps = after[0] - before[0]
        out.grammar_host_s = after[1] - before[1]
    return out


def progress_bar(
    args: argparse.Namespace, plan: RunPlan, rate: float, concurrency: int | None
) -> tqdm:
    return tqdm(
        total=len(plan.first) * (1 + len(plan.follow_ups)),
        desc=f"rate {rate}, max concurrency {concurrency}",
        disable=args.disable_tqdm,
    )


def run(
    args: argparse.Namespace,
    model: str,
    plan: RunPlan,
    rate: float,
    concurrency: int | None,
    rng: random.Random,
    schema: dict[str, Any] | None,
    pool: ProcessPoolExecutor | None,
) -> RunResult:
    """Send the plan's requests, turn by turn (Poisson arrivals at `rate`, at most `concurrency`
    in flight when set), asking for `schema` when given: from this process (`rng` drawing the
    arrivals), or from the client processes of `pool`; the results, the wall time and the
    grammar engine's work."""
    if pool is None:
        return asyncio.run(run_here(args, model, plan, rate, concurrency, rng, schema))
    return run_split(pool, args, model, plan, rate, concurrency, schema)


async def run_here(
    args: argparse.Namespace,
    model: str,
    plan: RunPlan,
    rate: float,
    concurrency: int | None,
    rng: random.Random,
    schema: dict[str, Any] | None,
) -> RunResult:
    """A run from this process (--client-processes 1), in one client: the warm-up, the grammar
    counters, the timed requests, the counters again."""
    async with open_client(args, concurrency or len(plan.first) + 1) as client:
        await warm_up(client, args, model, plan.warmup, schema)
        before = await grammar_counters(client, base_url(args))
        with progress_bar(args, plan, rate, concurrency) as bar:
            start = time.perf_counter()
            turns = await send_turns(
                client, args, model, plan, rate, concurrency, rng, schema, bar.update
            )
            duration = time.perf_counter() - start
        after = await grammar_counters(client, base_url(args))
    return run_result(merge_turns([turns]), duration, before, after)


@dataclass
class Share:
    """One client process's part of a run: its requests, at its rate and concurrency, from the
    common start (time.time())."""

    index: int
    plan: RunPlan
    rate: float
    concurrency: int | None
    start: float


@dataclass
class ShareResult:
    turns: list[Turn]
    end: float  # time.time() once its last request ended
    late_s: float  # how long after the common start it started (negative: it waited)


def split_plan(plan: RunPlan, k: int) -> list[RunPlan]:
    """The K client processes' parts of a run (the warm-up is this process's): request i to
    process i % K as conversation i, which merge_turns orders the results by. multi_turn's
    conversation i (numbered so already) stays in its process, its turns built from the run's
    user messages."""
    first = [replace(spec, conversation=i) for i, spec in enumerate(plan.first)]
    return [RunPlan([], first[i::k], plan.follow_ups) for i in range(k)]


def client_process(
    args: argparse.Namespace, model: str, share: Share, schema: dict[str, Any] | None
) -> ShareResult:
    """What each client process runs: its share of the run, in an event loop of its own."""
    return asyncio.run(send_share(args, model, share, schema))


async def send_share(
    args: argparse.Namespace, model: str, share: Share, schema: dict[str, Any] | None
) -> ShareResult:
    """Wait for the common start, then send the share's requests, with arrivals from a seed of
    the process's own (every process drawing the same gaps would send in lockstep)."""
    rng = random.Random(f"{args.seed}:{share.index}")
    async with open_client(args, share.concurrency or len(share.plan.first) + 1) as client:
        late_s = time.time() - share.start
        await asyncio.sleep(max(0.0, -late_s))
        plan, rate, concurrency = share.plan, share.rate, share.concurrency
        turns = await send_turns(
            client, args, model, plan, rate, concurrency, rng, schema, lambda: None
        )
        return ShareResult(turns, time.time(), late_s)


async def warmed_up_counters(
    args: argparse.Namespace,
    model: str,
    specs: list[RequestSpec],
    schema: dict[str, Any] | None,
) -> tuple[float, float] | None:
    """This process's part of a split run, before it (the warm-up `specs`, then the grammar
    counters) and after it (no specs: the counters)."""
    async with open_client(args, 1) as client:
        await warm_up(client, args, model, specs, schema)
        return await grammar_counters(client, base_url(args))


@contextlib.contextmanager
def client_pool(k: int) -> Iterator[ProcessPoolExecutor | None]:
    """None for K = 1 (the runs send from this process); else K spawned client processes for
    every run, started before the first: each imports this script again, and with it torch
    (seconds), which a run's common start would otherwise have to wait for."""
    if k == 1:
        yield None
        return
    context = multiprocessing.get_context("spawn")
    started = context.Barrier(k + 1)
    with ProcessPoolExecutor(k, mp_context=context, initializer=started.wait) as pool:
        for _ in range(k):  # a task each: the processes start as the tasks come
            pool.submit(int)
        started.wait(POOL_START_TIMEOUT_S)
        yield pool


def run_split(
    pool: ProcessPoolExecutor,
    args: argparse.Namespace,
    model: str,
    plan: RunPlan,
    rate: float,
    concurrency: int | None,
    schema: dict[str, Any] | None,
) -> RunResult:
    """A run from the K = `--client-processes` processes of `pool`, each sending its share from
    a common start a little ahead (time for the shares to reach them); the run's time is from
    that start to the last request's end, on the wall clock that they share."""
    k = args.client_processes
    before = asyncio.run(warmed_up_counters(args, model, plan.warmup, schema))
    start = time.time() + START_DELAY_S
    shares = [
        Share(i, part, rate / k, _share_of(concurrency, k, i), start)
        for i, part in enumerate(split_plan(plan, k))
    ]
    with progress_bar(args, plan, rate, concurrency) as bar:
        futures = [pool.submit(client_process, args, model, share, schema) for share in shares]
        for future in as_completed(futures):  # progress: a process's requests once it is done
            bar.update(sum(len(turn) for turn in future.result().turns))
        outs = [future.result() for future in futures]
    after = asyncio.run(warmed_up_counters(args, model, [], schema))
    if (late_s := max(out.late_s for out in outs)) > LATE_START_S:
        print(f"warning: a client process started {late_s:.2f} s late; the run's time counts it")
    duration = max(out.end for out in outs) - start
    return run_result(merge_turns([out.turns for out in outs]), duration, before, after)


def _share_of(concurrency: int | None, k: int, i: int) -> int | None:
    """Process `i`'s part of `concurrency` split over `k` (they add up to it)."""
    return None if concurrency is None else concurrency // k + (i < concurrency % k)


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    arr = np.asarray(values_s) * 1e3
    out: dict[str, float | None] = {f"mean_{name}_ms": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def summarize(
    args: argparse.Namespace,
    model: str,
    workload: str,
    rate: float,
    concurrency: int | None,
    run_result: RunResult,
    tp_size: int | None = None,
) -> dict[str, Any]:
    results, duration = run_result.results, run_result.duration
    ok = [r for r in results if r.ok]
    inputs = sum(r.input_len or 0 for r in ok)
    outputs = sum(r.output_len for r in ok)
    tpot = [
        (r.latency - r.ttft) / (r.output_len - 1)
        for r in ok
        if r.ttft is not None and r.output_len > 1
    ]
    reporting = [r for r in ok if r.cached_len is not None]  # their prompts' cached tokens
    cached = sum(r.cached_len or 0 for r in reporting)
    reported_inputs = sum(r.input_len or 0 for r in reporting)
    shown_rate = rate if math.isfinite(rate) else "inf"
    steps, host_s = run_result.grammar_steps, run_result.grammar_host_s
    row = {
        "name": f"serving {workload} rate={shown_rate} max_concurrency={concurrency}",
        "model": model,
        "tp_size": tp_size,  # as the server reports it (None: it does not)
        "workload": workload,
        "endpoint": args.endpoint,
        "dataset": prompt_source(args, workload),
        "request_rate": shown_rate,
        "max_concurrency": concurrency,
        "client_processes": args.client_processes,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "total_cached_tokens": cached if reporting else None,
        "cache_hit_rate": cached / reported_inputs if reported_inputs else None,
        "request_throughput": len(ok) / duration,
        "input_token_throughput": inputs / duration,
        "output_token_throughput": outputs / duration,
        **_stats("ttft", [r.ttft for r in ok if r.ttft is not None]),
        **_stats("itl", [gap for r in ok for gap in r.itl]),
        **_stats("tpot", tpot),
        **_stats("e2e", [r.latency for r in ok]),
        "valid_json": sum(bool(r.valid_json) for r in ok) if workload == "json_schema" else None,
        "grammar_steps": steps,
        "grammar_host_ms_per_step": host_s / steps * 1e3 if host_s is not None and steps else None,
    }
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def prompt_source(args: argparse.Namespace, workload: str) -> str:
    """Where a workload's prompts come from, for its summary row."""
    if workload in PREFIX_WORKLOADS:
        return "random"
    return "json_schema_prompt" if workload == "json_schema" else args.dataset


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_table(row: dict[str, Any]) -> None:
    print(f"\n{' serving benchmark ':=^60}")
    for key, value in row.items():
        print(f"{key:<40}{_shown(value):>20}")
    print("=" * 60)


def sweep_table(summary: list[dict[str, Any]]) -> str:
    """One line per run of `summary`: SWEEP_COLUMNS (latencies in ms)."""
    cells = [[heading for _, heading in SWEEP_COLUMNS]]
    cells += [[_shown(row.get(key)) for key, _ in SWEEP_COLUMNS] for row in summary]
    widths = [max(len(line[i]) for line in cells) for i in range(len(SWEEP_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


async def resolve_server(args: argparse.Namespace) -> tuple[str, int | None]:
    """(the model to ask for: `--model`, else the server's first, the tensor-parallel size
    the server reports at /get_server_info, as replaylm and SGLang do; None where it does not)."""
    base = base_url(args)
    async with open_client(args, 1, timeout=30) as client:
        model = args.model
        if not model:
            async with client.get(f"{base}/v1/models") as response:
                response.raise_for_status()
                model = json.loads(await response.read())["data"][0]["id"]
        async with client.get(f"{base}/get_server_info") as info:
            ok, body = info.status == 200, await info.read()
    try:
        tp_size = json.loads(body).get("tp_size") if ok else None
    except (ValueError, AttributeError):  # not JSON, or not an object
        tp_size = None
    return model, tp_size if isinstance(tp_size, int) else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat", "generate"),
        default="completions",
        help="generate: the native POST /generate",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        nargs="+",
        default=["plain"],
        help="plain sampling, structured output (the same JSON schema for every request), "
        "the prefix cache's workloads",
    )
    parser.add_argument(
        "--json-schema", type=Path, default=None, help="the json_schema workload's schema file"
    )
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--dataset", default="random", help="random, or a JSON(L) file or URL")
    parser.add_argument("--dataset-field", default=None)
    parser.add_argument("--dataset-output-len", type=int, default=128)
    parser.add_argument("--random-input-len", type=int, default=512)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument(
        "--random-dist",
        choices=LENGTH_DISTS,
        default="uniform",
        help="random prompts' and outputs' lengths: uniform up to the length, or lognormal "
        "around it (the median)",
    )
    parser.add_argument(
        "--random-range-ratio", type=float, default=0.5, help="uniform: the shortest share"
    )
    parser.add_argument(
        "--random-sigma", type=float, default=1.0, help="lognormal: sigma of ln(length)"
    )
    parser.add_argument(
        "--random-max-input-len",
        type=int,
        default=None,
        help="lognormal: the longest prompt (default 8 * --random-input-len)",
    )
    parser.add_argument(
        "--random-max-output-len",
        type=int,
        default=None,
        help="lognormal: the longest output (default 8 * --random-output-len)",
    )
    parser.add_argument(
        "--random-token-range",
        type=int,
        nargs=2,
        default=(100, 20000),
        help="token ids of random prompts are drawn from [LOW, HIGH)",
    )
    parser.add_argument("--prefix-len", type=int, default=2000, help="shared_prefix's prefix")
    parser.add_argument("--suffix-len", type=int, default=48, help="shared_prefix's own tokens")
    parser.add_argument("--turns", type=int, default=4, help="multi_turn's turns")
    parser.add_argument("--user-len", type=int, default=256, help="multi_turn's user messages")
    parser.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests per second (Poisson); inf = all at once",
    )
    parser.add_argument(
        "--rate-seconds",
        type=float,
        default=None,
        help=f"at a finite rate R, send round(R * S) requests (at least {MIN_RATE_PROMPTS}) "
        "instead of --num-prompts",
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
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        metavar="K",
        help="split each run's requests over K client processes (rate / K and C / K in "
        "flight each), so that the client does not cap the server (default 1: this one)",
    )
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--json-requests",
        action="store_true",
        help="with --json: add one record per request (a large file)",
    )
    args = parser.parse_args(argv)
    args.random_max_input_len = args.random_max_input_len or 8 * args.random_input_len
    args.random_max_output_len = args.random_max_output_len or 8 * args.random_output_len
    if args.random_sigma <= 0:
        parser.error("--random-sigma must be positive")
    if args.rate_seconds is not None and args.rate_seconds <= 0:
        parser.error("--rate-seconds must be positive")
    if args.client_processes < 1:
        parser.error("--client-processes must be at least 1")
    if any(c is not None and c < args.client_processes for c in args.max_concurrency):
        parser.error("--max-concurrency must be at least --client-processes (one each)")
    if args.dataset == "random" and args.endpoint == "chat" and "plain" in args.workload:
        parser.error("--dataset random sends token-id prompts: use --endpoint completions")
    if "multi_turn" in args.workload and args.endpoint != "generate":
        parser.error("multi_turn appends the answers' token ids: use --endpoint generate")
    if "shared_prefix" in args.workload and args.endpoint == "chat":
        parser.error("shared_prefix sends token-id prompts: use --endpoint completions")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    most = max(run_prompts(args, rate) for rate in args.request_rate)
    # one list for every run: a dataset's prompts, and json_schema's output lengths
    if args.dataset != "random":
        specs = dataset_specs(args, rng, most)
    else:
        specs = random_specs(args, rng, most) if "json_schema" in args.workload else []
    schema = json.loads(args.json_schema.read_text()) if args.json_schema else RECORD_SCHEMA
    structured = json_schema_specs(specs, schema, random.Random(args.seed))  # leaves `rng` be
    model, tp_size = asyncio.run(resolve_server(args))
    summary, requests = [], []
    with client_pool(args.client_processes) as pool:  # None: from this process
        runs = itertools.product(args.workload, args.request_rate, args.max_concurrency)
        for workload, rate, concurrency in runs:
            wanted = schema if workload == "json_schema" else None
            sent = structured if workload == "json_schema" else specs
            plan = run_plan(args, workload, rng, run_prompts(args, rate), sent)
            result = run(args, model, plan, rate, concurrency, rng, wanted, pool)
            row = summarize(args, model, workload, rate, concurrency, result, tp_size)
            print_table(row)
            errors = [r.error for r in result.results if not r.ok]
            if errors:
                print(f"{len(errors)} requests failed; the first: {errors[0]}")
            summary.append(row)
            requests += [
                {
                    "workload": workload,
                    "request_rate": row["request_rate"],
                    "max_concurrency": concurrency,
                    # the generated ids are left out: the counts say enough
                    **{k: v for k, v in asdict(r).items() if k != "output_ids"},
                }
                for r in result.results
            ]
    print(f"\n{sweep_table(summary)}")
    if args.json:
        config = {
            **vars(args),
            "json": args.json.name,  # the file's name only: no path of this machine
            "json_schema": schema,
            "request_rate": [str(r) for r in args.request_rate],
        }
        record = {"config": config, "summary": summary}
        if args.json_requests:
            record["requests"] = requests
        write_json(args.json, record)


if __name__ == "__main__":
    main()
