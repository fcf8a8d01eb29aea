"""Shared by every test directory.

Without a CUDA GPU, Triton kernels can only run in Triton's interpreter (on CPU tensors); the
switch is read when a kernel is defined, so it is set here, before any test module imports one.

HTTP servers for the CPU tests: `http_server` is the built-in SmolLM2 on CPU, started once per
session (~20-30 s) and shared by the HTTP test modules (test/cpu) and the accuracy harness test
(test/accuracy); `server_factory` starts further ones (tiny checkpoints: seconds).
`tiny_qwen3_runner`: a CPU ModelRunner of a tiny Qwen3 checkpoint, for graph-runner tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from http_helpers import HTTP_SERVER_FLAGS
from server_process import ServerProcess, start_server

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA: skip them, visibly, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def http_server() -> Iterator[ServerProcess]:
    server = start_server(*HTTP_SERVER_FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server_factory() -> Iterator[Callable[..., ServerProcess]]:
    """`server_factory(*flags)` starts a server; all are stopped after the module."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        started.append(start_server(*args))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tiny_qwen3_runner(tmp_path_factory):
    """A CPU ModelRunner of a tiny random Qwen3 (512 KV slots, 8 request rows), per module."""
    # imported here, after TRITON_INTERPRET is set: they load modules that import triton
    from replaylm.model_executor.engine_config import resolve_engine_config
    from replaylm.model_executor.runner_setup import load_model_runner
    from replaylm.server_args import ServerArgs

    from tiny_checkpoints import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny_qwen3")
    write_tiny_checkpoint("qwen3", folder)
    return load_model_runner(
        resolve_engine_config(
            ServerArgs(
                model_path=str(folder), device="cpu", max_total_tokens=512, max_running_requests=8
            )
        )
    )
