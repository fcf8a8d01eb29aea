"""What the scripts in benchmark/ and benchmark/tuning/ share: model configs, CUDA timing, graph
capture, the environment a result was measured in, JSON output, servers started for a run,
dummy-weight runners with synthetic requests, the prefix-cache workloads' prompts, and the
attention kernels' cases.

Scripts in benchmark/ import it as `common` (their folder is on the path when run); those in
benchmark/tuning/ put benchmark/ on the path first.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
import triton
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from replaylm.layers.attention.triton.common import KernelConfig
from replaylm.layers.attention.triton.decode import (
    MIN_SPLIT_LEN,
    decode_attention,
    longest_first,
    num_kv_splits,
)
from replaylm.layers.attention.triton.extend import extend_attention
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.forward_batch import ForwardBatch
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runner, load_model_runners
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend
from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

BENCHMARK_DIR = Path(__file__).resolve().parent
REPO = BENCHMARK_DIR.parent
CONFIGS = BENCHMARK_DIR / "configs"
RESULTS = BENCHMARK_DIR / "results"  # results/<gpu_slug>/<benchmark>.json: what the docs show


# ---- model configs -------------------------------------------------------------------------------


def config_path(model: str) -> Path:
    """benchmark/configs/<model>.json: a real model's config.json, loaded with dummy weights."""
    return CONFIGS / f"{model}.json"


def model_config(model: str) -> dict[str, Any]:
    return json.loads(config_path(model).read_text())


# ---- timing --------------------------------------------------------------------------------------


def cuda_time_ms(
    fn: Callable[[], object], warmup: int = 10, repeat: int = 50, calls: int = 1
) -> float:
    """Median milliseconds per `fn()` call by CUDA events around `calls` back-to-back calls (no
    wait between them), after `warmup` untimed calls; `repeat` timings."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written per second), 1 GiB buffers: the ceiling
    that decode steps and memory-bound kernels are measured against."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, repeat=20)
    return 2 * src.numel() / (ms / 1e3) / 1e9


def capture_graph(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `body()`, run once first (Triton compiles, cuBLAS plans) outside it."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def replay_us(body: Callable[[], object], warmup: int = 20, repeat: int = 100) -> float:
    """Median microseconds per replay of a CUDA graph of `body()`."""
    return cuda_time_ms(capture_graph(body).replay, warmup, repeat) * 1e3


def kernel_table(replay: Callable[[], object], replays: int) -> tuple[list[dict], float]:
    """(rows of {kernel, per_step, each_us, median_us, total_us} by total time, kernel
    microseconds per step) of `replays` calls of `replay` under the profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            times[event.name].append(event.device_time)
    rows = [
        {
            "kernel": name[:90],
            "per_step": len(ts) / replays,
            "each_us": sum(ts) / len(ts),
            "median_us": statistics.median(ts),
            "total_us": sum(ts) / replays,
        }
        for name, ts in times.items()
    ]
    rows.sort(key=lambda r: -r["total_us"])
    return rows, sum(r["total_us"] for r in rows)


# kernel-name fragments -> the category a whole-run profile counts that kernel under (first match;
# "other" for none): cuBLAS's matmuls are named nvjet/gemm/xmma/cutlass on H100
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matmul", ("nvjet", "gemm", "xmma", "cutlass", "splitkreduce", "_skinny_matmul")),
    ("decode attention", ("_decode_kernel", "_merge_kernel", "radixsort")),
    ("prefill attention", ("_extend_kernel", "prefill")),
    ("norms", ("_rms_norm",)),
    ("activation", ("_silu_mul",)),
    ("rope and KV store", ("_qk_norm_rope", "_store_kv")),
    ("sampling", ("argmax", "_penalties")),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in lowered for f in fragments):
            return category
    return "other"


def gpu_seconds(run: Callable[[], object]) -> dict[str, float]:
    """`run()` under the profiler: its wall seconds, the seconds some kernel ran ("busy", the
    union of their intervals) and the kernels' summed seconds per KERNEL_CATEGORIES entry."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    out: dict[str, float] = defaultdict(float)
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            out[kernel_category(event.name)] += event.device_time / 1e6
            spans.append((event.time_range.start, event.time_range.end))
    busy_us, reach = 0.0, float("-inf")
    for begin, end in sorted(spans):
        busy_us += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    return {"wall": wall, "busy": busy_us / 1e6, **out}


# ---- results -------------------------------------------------------------------------------------


def _command_output(*cmd: str) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _portable(arg: str) -> str:
    """A command-line argument as it reads on any machine: an absolute path (or `--flag=` one)
    under the repository relative to it, any other absolute path by its file name."""
    if arg.startswith("--") and "=" in arg:
        flag, value = arg.split("=", 1)
        return f"{flag}={_portable(value)}"
    if not os.path.isabs(arg):
        return arg
    path = Path(arg).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def run_command(argv: list[str]) -> str:
    """The command line `argv` (sys.argv's shape) as typed at the repository's root: `python`,
    the script's path, its arguments (`_portable`) less `--json PATH`, which only says where the
    result went."""
    args: list[str] = []
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--json":
            next(rest, None)
        elif not arg.startswith("--json="):
            args.append(_portable(arg))
    script = os.path.abspath(argv[0])  # argv[0] is relative to the folder it was run from
    return shlex.join(["python", _portable(script), *args])


def gpu_slug(gpu: str | None) -> str:
    """The folder under results/ of what ran on the device named `gpu` (None: the CPU): the
    model's short lowercase name, "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090"
    -> "rtx4090"."""
    if gpu is None:
        return "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", gpu.lower()) if w]
    for i, word in enumerate(words):
        if any(c.isdigit() for c in word):
            return words[i - 1] + word if word.isdigit() and i > 0 else word
    return "".join(words)


@functools.cache
def environment() -> dict[str, str | None]:
    """What a result depends on besides its arguments, and where it came from: the GPU, its
    driver, torch, CUDA and triton versions, the commit measured (None for what this machine
    cannot tell), the date (UTC) and this process's command line (`run_command`)."""
    cuda = torch.cuda.is_available()
    driver = _command_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    commit = _command_output("git", "rev-parse", "--short", "HEAD")
    if commit and _command_output("git", "status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "driver": driver.splitlines()[0] if driver else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "command": run_command(sys.argv),
    }


def json_path_arg(doc: str | None) -> Path | None:
    """The command line of a script whose one option is `--json PATH` (where its results go)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    return parser.parse_args().json


def portable_values(value: Any) -> Any:
    """`value` (a JSON document) with every string that is a path of this machine (absolute, in
    a folder that exists: not an HTTP route) made `_portable`: a result names no path of the
    machine it ran on."""
    if isinstance(value, dict):
        return {k: portable_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_values(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value) and Path(value).parent.is_dir():
        return _portable(value)
    return value


def write_json(path: Path, doc: dict[str, Any], command: str | None = None) -> None:
    """Write a benchmark's result `doc` to `path` (its folders made), with the `environment` it
    was measured in where `doc` has none; `command`: the command line recorded, when not this
    process's. Absolute paths are written relative to the repository, or by their file name."""
    env = environment() | ({"command": command} if command else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable_values({"environment": env, **doc}), indent=1))


def add_environment(path: Path, command: str) -> None:
    """Give the JSON at `path`, written by `command` (a tool that does not use `write_json`, as
    the accuracy suite), the environment block a benchmark's result carries."""
    write_json(path, json.loads(path.read_text()), command)


def release_memory() -> None:
    """Free what the last runner or engine held (model, KV cache, graphs) before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(server_args: list[str], log: Path, timeout_s: float = 600.0) -> Iterator[str]:
    """`python -m replaylm.launch_server *server_args` on a free loopback port, its output in
    `log`: yields its base URL once GET /health answers, and stops it when the block ends.
    RuntimeError with the log's tail when it exits or is not healthy within `timeout_s`."""
    port = free_port()
    cmd = [sys.executable, "-m", "replaylm.launch_server", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *server_args]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while not _healthy(url):
                if proc.poll() is not None:
                    state = f"exited with {proc.returncode}"
                elif time.monotonic() > deadline:
                    state = f"not healthy after {timeout_s:.0f} s"
                else:
                    time.sleep(0.25)
                    continue
                raise RuntimeError(f"server {state}:\n{log.read_text()[-3000:]}")
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


# ---- dummy-weight runners and synthetic requests ------------------------------------------------


def dummy_runner(
    model: str,
    modes: str,
    max_bs: int,
    context: int,
    extra: dict[str, Any] | None = None,
    tp_rank: int = 0,
) -> ModelRunner:
    """A CUDA runner of `model`'s config with dummy bf16 weights under `--cuda-graph-mode modes`,
    room for `max_bs` requests of `context` tokens, default decode shapes (up to 256 running
    requests, unless `extra` says) and prefill buckets (up to 2048); `extra`: further ServerArgs
    fields (with `tp_size` and `dist_init_addr`: the runner of rank `tp_rank`)."""
    fields: dict[str, Any] = {"max_running_requests": 256, **(extra or {})}
    return load_model_runner(
        resolve_engine_config(
            ServerArgs(
                model_path=str(config_path(model)),
                load_format="dummy",
                device="cuda",
                dtype="bfloat16",
                context_length=max(context, 2048) + 64,
                max_total_tokens=max_bs * (context + 64) + 4096,
                cuda_graph_mode=modes,
                chunked_prefill_size=2048,
                mem_fraction_static=0.85,
                **fields,
            )
        ),
        tp_rank=tp_rank,
    )


PREFILL_CHUNK = 2048  # the server's default --chunked-prefill-size


def build_runner(
    model_path: str,
    device: str,
    max_bs: int,
    tokens_per_req: int,
    extra: dict[str, Any] | None = None,
) -> ModelRunner:
    """A runner of `model_path` (a `.json` config: dummy weights) on `device`, default modes,
    whose KV pool and request table hold `max_bs` requests of `tokens_per_req` tokens (the KV
    pool less where the GPU's memory ends first); `extra`: further ServerArgs fields."""
    return build_runners(model_path, device, max_bs, tokens_per_req, extra)[0]


def build_runners(
    model_path: str,
    device: str,
    max_bs: int,
    tokens_per_req: int,
    extra: dict[str, Any] | None = None,
) -> tuple[ModelRunner, ModelRunner | None]:
    """`build_runner`'s runner and its drafter's (a draft model or EAGLE head that `extra`
    names, loaded as the target is; None without one)."""
    return load_model_runners(
        resolve_engine_config(
            ServerArgs(
                model_path=model_path,
                load_format="dummy" if model_path.endswith(".json") else "auto",
                device=device,
                max_running_requests=max_bs,
                context_length=tokens_per_req,
                max_total_tokens=max_bs * tokens_per_req + 64,
                chunked_prefill_size=PREFILL_CHUNK,
                **(extra or {}),
            )
        )
    )


def synthetic_requests(n: int, length: int) -> list[Req]:
    """`n` requests of `length` prompt tokens each, distinct and deterministic."""
    return [
        Req(i, [(i * 31 + j) % 1000 + 10 for j in range(length)], SamplingParams(), 0, 8)
        for i in range(n)
    ]


def decode_batch(
    runner: ModelRunner, bs: int, context: int, one_at_a_time: bool = False
) -> tuple[list[Req], ForwardBatch]:
    """`bs` requests prefilled eagerly with `context` tokens each (in one batch, or with
    `one_at_a_time` a batch each: an EAGLE head's forwards are bounded), and their next decode
    batch."""
    reqs = synthetic_requests(bs, context)
    for group in [[r] for r in reqs] if one_at_a_time else [reqs]:
        runner.forward(prepare_extend(group, runner))
    for r in reqs:
        r.output_ids.append(11)
    return reqs, prepare_decode(reqs, runner)


SCHEDULER_WARMUP_STEPS = 20  # untimed decode steps before `scheduler_decode_ms` times any


def bench_scheduler(runner: ModelRunner, prefix_cache: bool = True) -> Scheduler:
    """A Scheduler over `runner` as a server runs it (the overlap schedule, default chunks)."""
    return Scheduler(runner, frozenset(), None, PREFILL_CHUNK, None, prefix_cache=prefix_cache)


def scheduler_decode_ms(sched: Scheduler, reqs: list[Req], steps: int) -> float:
    """Milliseconds per decode step of `reqs` through `sched` (the runner's CUDA-graph modes):
    every request prefilled and decoding, then SCHEDULER_WARMUP_STEPS untimed steps, then
    `steps` timed ones (the device synchronised before and after). The requests need
    max_new_tokens > SCHEDULER_WARMUP_STEPS + steps; they are aborted after, their KV freed and
    the prefix cache flushed (the runner's pool is reused)."""
    device = sched.runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for req in reqs:
        sched.add(req)
    while sched.waiting or len(sched.running) < len(reqs):  # prefill steps
        sched.step()
    for _ in range(SCHEDULER_WARMUP_STEPS):
        sched.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sync()
    elapsed = time.perf_counter() - start
    for req in reqs:
        sched.abort(req.rid)
    sched.run_to_completion()
    sched.prefix_cache.flush()
    return elapsed / steps * 1e3


# ---- prefix-cache workloads (bench_prefix.py in-process, bench_serving.py over HTTP) -----------


def shared_prefix_prompts(
    draw: Callable[[int], list[int]], num: int, prefix_len: int, suffix_len: int
) -> list[list[int]]:
    """`num` prompts: one `prefix_len`-token prefix shared by all, then `suffix_len` tokens of
    each one's own; `draw(n)` returns `n` random token ids."""
    prefix = draw(prefix_len)
    return [prefix + draw(suffix_len) for _ in range(num)]


def next_turn_prompts(
    prompts: list[list[int]], answers: list[list[int]], messages: list[list[int]]
) -> list[list[int]]:
    """Each conversation's next prompt: its last prompt, the answer generated for it (token ids)
    and a new user message."""
    return [p + a + m for p, a, m in zip(prompts, answers, messages, strict=True)]


# ---- attention kernels' cases (Qwen3-0.6B's heads) -----------------------------------------------

HEADS, KV_HEADS, DIM = 16, 8, 128
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 10  # decode calls per timed graph, each on other random KV slots


def median_ms(fn: Callable[[], object]) -> float:
    """triton.testing.do_bench's median (L2 flushed before each timing)."""
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_ms(fn: Callable[[int], object], calls: int = CALLS_PER_GRAPH) -> float:
    """Milliseconds per call of `fn(i)`, i = 0..calls-1, replayed from one CUDA graph."""

    def body() -> None:
        for i in range(calls):
            fn(i)

    return median_ms(capture_graph(body).replay) / calls


class KVCache:
    """One layer's K and V of `slots` random tokens in `dtype` (an fp8 cache's: its values
    rounded from DTYPE's); slot 0 is padding."""

    def __init__(self, slots: int, dtype: torch.dtype = DTYPE) -> None:
        shape = (slots + 1, KV_HEADS, DIM)
        self.k = torch.randn(shape, device="cuda", dtype=DTYPE).to(dtype)
        self.v = torch.randn(shape, device="cuda", dtype=DTYPE).to(dtype)
        self.slots = slots

    def tables(self, bs: int, ctx: int, n: int, contiguous: bool = False) -> list[torch.Tensor]:
        """`n` request-to-token tables `[bs, ctx]` of distinct random slots each (or, with
        `contiguous`, each request on consecutive slots from a random start)."""

        def one() -> torch.Tensor:
            if not contiguous:
                return 1 + torch.randperm(self.slots, device="cuda")[: bs * ctx]
            start = int(torch.randint(0, self.slots - bs * ctx + 1, ()))
            return 1 + start + torch.arange(bs * ctx, device="cuda")

        return [one().to(torch.int32).view(bs, ctx) for _ in range(n)]


def time_decode_attention(
    cache: KVCache,
    bs: int,
    ctx: int,
    config: KernelConfig | None = None,
    splits: int | None = None,
    min_split_len: int = MIN_SPLIT_LEN,
    contiguous: bool = False,
    lengths: torch.Tensor | None = None,
    longest: bool = False,
) -> float:
    """Milliseconds per decode attention call of `bs` requests over `ctx` tokens (or `lengths`
    `[bs]`, at most `ctx` each), merged by the merge kernel as captured graphs do; `splits`
    slices of at least `min_split_len` tokens (default: the model's launch, `num_kv_splits` and
    MIN_SPLIT_LEN); `longest`: the programs start longest request first."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = splits or num_kv_splits(bs, KV_HEADS, sms)
    tables = cache.tables(bs, ctx, CALLS_PER_GRAPH, contiguous)
    q = torch.randn(bs, HEADS, DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    rows = torch.arange(bs, device="cuda")
    seq_lens = torch.full((bs,), ctx, device="cuda") if lengths is None else lengths.cuda()
    order = longest_first(seq_lens) if longest else None
    return graph_ms(
        lambda i: decode_attention(
            q,
            cache.k,
            cache.v,
            tables[i],
            rows,
            seq_lens,
            out,
            DIM**-0.5,
            splits,
            min_split_len=min_split_len,
            config=config,
            separate_merge=True,
            order=order,
        )
    )


def mixed_lengths(bs: int, generator: torch.Generator) -> torch.Tensor:
    """`bs` decode lengths uniform in 100-2048 tokens: the spread of nano-vllm's offline batches
    (the mixed-length decode cases of bench_attention and the attention sweep)."""
    return torch.randint(100, 2049, (bs,), generator=generator)


def mixed_decode_bytes(lengths: torch.Tensor) -> int:
    """`decode_attention_bytes` of a batch of these `lengths`."""
    return sum(decode_attention_bytes(1, int(n)) for n in lengths)


def decode_attention_bytes(bs: int, ctx: int, kv_itemsize: int = DTYPE.itemsize) -> int:
    """What a decode attention call must move: K and V once (`kv_itemsize` bytes a value), the
    slot table, q and out."""
    kv = 2 * bs * ctx * KV_HEADS * DIM * kv_itemsize
    return kv + 4 * bs * ctx + 2 * bs * HEADS * DIM * DTYPE.itemsize


class ExtendCase:
    """Requests of `new` tokens each on `prefix` cached tokens, over a fresh random cache."""

    def __init__(self, n: int, new: int, prefix: int) -> None:
        t = n * new
        self.q = torch.randn(t, HEADS, DIM, device="cuda", dtype=DTYPE)
        self.k = torch.randn(t, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
        self.v = torch.randn(t, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
        self.cache = KVCache(n * (prefix + new))
        self.table = self.cache.tables(n, prefix + new, 1)[0]
        self.rows = torch.arange(n, device="cuda")
        self.prefix = torch.full((n,), prefix, device="cuda")
        self.new_lens = torch.full((n,), new, device="cuda")
        self.start = torch.arange(n, device="cuda") * new
        self.out = torch.empty_like(self.q)
        self.n, self.new, self.prefix_len = n, new, prefix

    def run(self, config: KernelConfig | None = None) -> None:
        extend_attention(
            self.q,
            self.k,
            self.v,
            self.out,
            self.cache.k,
            self.cache.v,
            self.table,
            self.rows,
            self.prefix,
            self.new_lens,
            self.start,
            self.new,
            DIM**-0.5,
            config=config,
        )

    def flops(self) -> float:
        """The causal FLOPs (masked pairs not counted)."""
        pairs = self.new * self.prefix_len + self.new * (self.new + 1) / 2
        return 4 * self.n * HEADS * DIM * pairs
