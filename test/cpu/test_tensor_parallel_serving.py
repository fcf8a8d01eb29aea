"""Tensor parallelism end to end on the CPU (gloo ranks on loopback): the offline Engine, a
server and a two-"node" server with `--tp-size 2` generate what one rank generates (greedy and
seeded sampling, with chunked prefill, retraction and aborts in the mix); the graph path under
`--debug-cuda-graph`; a rank that dies ends the server with exit code 1 and a line naming it, or
its start (while the model loads) with one `error:` line, as do sizes that do not divide the
model and tensor-parallel flags that do not fit together."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from replaylm.entrypoints.engine import Engine
from replaylm.model_executor.cuda_graph.config import debug_eager_modes

from http_helpers import metric
from server_process import ServerProcess, free_port, start_server
from tiny_checkpoints import write_tiny_checkpoint
from tp_ranks import write_dummy_config

_rng = random.Random(0)
# prompts longer than a prefill chunk, and more KV than the pool holds at once (retraction)
PROMPTS = [[_rng.randrange(3, 320) for _ in range(_rng.randrange(2, 60))] for _ in range(32)]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
# every other request samples (seeded, with a penalty): the ranks take rank 0's sampled ids
PARAMS = [
    GREEDY
    if i % 2 == 0
    else {**GREEDY, "temperature": 0.8, "top_p": 0.9, "seed": i, "frequency_penalty": 0.3}
    for i in range(len(PROMPTS))
]
LIMITS = {
    "max_total_tokens": 400,
    "chunked_prefill_size": 32,
    "max_running_requests": 16,
    "context_length": 256,
}
FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny_llama3")
    write_tiny_checkpoint("llama3", folder)
    return str(folder)


def _engine_outputs(checkpoint: str, **args: object) -> tuple[list[list[int]], int]:
    """The outputs of PROMPTS under PARAMS and the number of retractions it took."""
    engine = Engine(checkpoint, device="cpu", **{**LIMITS, **args})  # type: ignore[arg-type]
    try:
        out = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        return [o["output_ids"] for o in out], engine.scheduler.stats().num_retractions
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def one_rank(checkpoint: str) -> list[list[int]]:
    outputs, retractions = _engine_outputs(checkpoint)
    assert retractions > 0  # the pool is small enough to force it
    return outputs


@pytest.mark.parametrize("mixed", [False, True])
def test_engine_on_two_ranks_generates_what_one_rank_does(checkpoint, one_rank, mixed):
    """Also with mixed chunks: every rank mixes the same decode tokens into the same steps."""
    outputs, retractions = _engine_outputs(checkpoint, tp_size=2, enable_mixed_chunk=mixed)
    assert retractions > 0
    assert outputs == one_rank


@pytest.mark.parametrize("algorithm", ["ngram", "draft_model"])
def test_speculating_on_two_ranks_generates_what_one_rank_does(checkpoint, one_rank, algorithm):
    """Every rank verifies the same drafts (a draft model's are rank 0's) and keeps the same
    tokens, so speculation changes nothing, retraction included."""
    draft = {"speculative_draft_model_path": checkpoint} if algorithm == "draft_model" else {}
    outputs, retractions = _engine_outputs(
        checkpoint, tp_size=2, speculative_algorithm=algorithm, **draft
    )
    assert retractions > 0
    assert outputs == one_rank


def test_a_model_without_a_tokenizer_generates_on_two_ranks(tmp_path):
    """Dummy weights from a bare config (no tokenizer, so no grammar engine): plain requests
    need neither."""
    config = write_dummy_config(tmp_path)
    args = {"load_format": "dummy", "device": "cpu", **LIMITS}
    outputs = []
    for tp_size in (1, 2):
        engine = Engine(str(config), tp_size=tp_size, **args)  # type: ignore[arg-type]
        try:
            assert engine.tokenizer is None
            out = engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)
            outputs.append([o["output_ids"] for o in out])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1] and all(len(ids) == 16 for ids in outputs[0])


def test_cache_flush_reaches_every_rank(checkpoint, one_rank):
    """After a run and `flush_cache`, the ranks batch the same prompts alike again: a rank
    still holding cached prefixes would prefill fewer tokens than rank 0 and break step."""
    engine = Engine(checkpoint, device="cpu", tp_size=2, **LIMITS)  # type: ignore[arg-type]
    try:
        engine.generate(input_ids=PROMPTS[:8], sampling_params=PARAMS[:8])
        assert engine.flush_cache() > 0
        out = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        assert [o["output_ids"] for o in out] == one_rank
    finally:
        engine.shutdown()


def test_debug_graph_path_on_two_ranks_generates_what_one_rank_does(checkpoint, one_rank):
    """Both modes that `--debug-cuda-graph` runs eagerly, one per phase: the collectives run
    inside breakable segments and inside the pieces torch.compile traced."""
    assert set(debug_eager_modes()) == {"breakable", "tc_piecewise"}
    outputs, _ = _engine_outputs(
        checkpoint,
        tp_size=2,
        debug_cuda_graph=True,
        tc_piecewise_compiler="eager",
        cuda_graph_mode=json.dumps({"decode": "tc_piecewise", "prefill": "breakable"}),
        decode_cuda_graph_bs=[1, 2, 4, 8, 16],
        prefill_cuda_graph_tokens=[32, 64],
    )
    assert outputs == one_rank


def _serve(server: ServerProcess) -> list[list[int]]:
    """PROMPTS through `server`, all at once, with streams cut after their first token in the
    mix (aborted requests); the outputs in prompt order."""

    def generate(ids: list[int], params: dict[str, object]) -> list[int]:
        body = {"input_ids": ids, "sampling_params": params}
        response = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["output_ids"]

    def abort(ids: list[int]) -> None:
        body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 200}}
        with httpx.stream(
            "POST", f"{server.base_url}/generate", json={**body, "stream": True}, timeout=120
        ) as response:
            next(response.iter_lines())

    with ThreadPoolExecutor(len(PROMPTS) + 4) as pool:
        aborts = [pool.submit(abort, ids) for ids in PROMPTS[:4]]
        outputs = list(pool.map(generate, PROMPTS, PARAMS))
        for aborted in aborts:
            aborted.result()
    return outputs


def test_server_on_two_ranks_generates_what_one_rank_does(server_factory, checkpoint, one_rank):
    server = server_factory("--model-path", checkpoint, "--tp-size", "2", *FLAGS)
    assert _serve(server) == one_rank
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert metric(http, 'replaylm_requests_total{finish_reason="abort"}') > 0
        assert metric(http, "replaylm_num_preemptions") > 0
        assert http.post("/flush_cache").status_code == 200  # every rank flushes, rank 0 answers
        info = http.get("/get_server_info").json()
    assert info["tp_size"] == 2


@pytest.fixture
def other_node(checkpoint: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """`start(*flags)`: a `--node-rank 1` launch_server (no HTTP), killed after the test; the
    i-th one started logs to `tmp_path / f"other_node_{i}.log"`."""
    started: list[subprocess.Popen[str]] = []

    def start(*flags: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "replaylm.launch_server", "--device", "cpu", *flags]
        with open(tmp_path / f"other_node_{len(started)}.log", "w") as log:
            started.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_nodes_on_loopback_generate_what_one_rank_does(
    checkpoint, one_rank, other_node, tmp_path
):
    group = ["--tp-size", "2", "--nnodes", "2", f"--dist-init-addr=127.0.0.1:{free_port()}"]
    node1 = other_node("--model-path", checkpoint, *group, "--node-rank", "1", *FLAGS)
    node0 = start_server("--model-path", checkpoint, *group, "--node-rank", "0", *FLAGS)
    try:
        assert _serve(node0) == one_rank
    finally:
        node0.stop()
    # rank 0's shutdown ends the other node's rank
    assert node1.wait(timeout=30) == 0, (tmp_path / "other_node_0.log").read_text()[-4000:]


def test_a_rank_that_dies_stops_the_server(server_factory, checkpoint):
    server = server_factory("--model-path", checkpoint, "--tp-size", "2", "--log-level", "info")
    log = server.stderr_tail(chars=1_000_000)
    rank1 = re.search(r"tensor parallelism: rank 1 of 2 \(pid (\d+)\)", log)
    assert rank1 is not None, log
    os.kill(int(rank1.group(1)), signal.SIGKILL)
    start = time.monotonic()
    assert server.proc.wait(timeout=60) == 1
    assert time.monotonic() - start < 20, "the server took too long to exit"
    log = server.stderr_tail(chars=1_000_000)
    assert (
        "stopping the server (exit code 1): the scheduler process of tensor-parallel rank 1 "
        "exited (code -9)" in log
    )


def test_a_size_that_does_not_divide_the_heads_is_one_error_line(checkpoint):
    cmd = [sys.executable, "-m", "replaylm.launch_server", "--device", "cpu"]
    flags = ["--model-path", checkpoint, "--tp-size", "3", "--log-level", "warning"]
    result = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: --tp-size 3 does not divide the model's 4 attention heads"]


def test_tp_flags_that_do_not_fit_are_errors_naming_them():
    cmd = [sys.executable, "-m", "replaylm.launch_server", "--device", "cpu"]
    for flags, message in (
        (["--tp-size", "3", "--nnodes", "2"], "--tp-size 3 is not a multiple of --nnodes 2"),
        (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1", "--tp-size", "2"],
         "--node-rank must be in [0, 1] for --nnodes 2, got 2"),
        (["--tp-size", "2", "--dist-init-addr", "nowhere"], "--dist-init-addr must be HOST:PORT"),
    ):  # fmt: skip
        result = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"error: {message}"), result.stderr


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing `spawn` children of process `pid`, oldest first."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    spawned = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sorted(int(c) for c in spawned)


def test_a_rank_that_dies_while_loading_fails_the_start(checkpoint):
    """Rank 1 killed as soon as it is spawned: rank 0 would wait for it to join its group; the
    front end sees the exit and ends the start with one error line (exit code 2)."""
    cmd = [sys.executable, "-m", "replaylm.launch_server", "--device", "cpu"]
    flags = ["--model-path", checkpoint, "--tp-size", "2", "--log-level", "warning"]
    flags += ["--port", str(free_port())]  # it listens before loading: not a port in use
    proc = subprocess.Popen([*cmd, *flags], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(children := _spawned_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(children[1], signal.SIGKILL)  # rank 1: spawned after rank 0
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "tensor-parallel rank" in lines[0], stderr
