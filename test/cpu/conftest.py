"""Clients of the shared SmolLM2 server (test/conftest.py's `http_server`) for the HTTP test
modules, and one tiny keyed server that the modules needing a tokenizer-less model share."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from http_helpers import TIMEOUT_S, TINY_API_KEY
from server_process import ServerProcess, start_server
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Llama 3 checkpoint's folder (the scheduler tests' model)."""
    path = tmp_path_factory.mktemp("tiny_llama3")
    write_tiny_checkpoint("llama3", path)
    return str(path)


@pytest.fixture(scope="module")
def client(http_server: ServerProcess) -> openai.OpenAI:
    """The official `openai` client of `http_server`."""
    return openai.OpenAI(
        base_url=f"{http_server.base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="module")
def http(http_server: ServerProcess) -> Iterator[httpx.Client]:
    """An httpx client of `http_server`, for the raw routes and bodies."""
    with httpx.Client(base_url=http_server.base_url, timeout=TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A tiny random Qwen2 served as `tiny` behind the key TINY_API_KEY; it has no tokenizer
    (token-id prompts only) and starts in seconds."""
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    write_tiny_checkpoint("qwen2", folder)
    server = start_server(
        "--model-path",
        str(folder),
        "--max-total-tokens",
        "256",
        "--api-key",
        TINY_API_KEY,
        "--served-model-name",
        "tiny",
    )
    yield server
    server.stop()
