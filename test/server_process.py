"""Real HTTP servers for tests: `python -m replaylm.launch_server` subprocesses on loopback
ports, waited on until healthy, failing with the server's stderr when they die."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

import httpx
import pytest

STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    stderr: IO[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr_tail(self, chars: int = 6000) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-chars:]

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Poll GET /health until 200; fail with the server's stderr if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"server exited with code {self.proc.returncode} during startup:\n"
                    f"{self.stderr_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server not healthy after {timeout_s:.0f} s:\n{self.stderr_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def start_server(*args: str, device: str = "cpu") -> ServerProcess:
    """Start `launch_server` on `device` on a free loopback port with `args`; wait until
    healthy."""
    server = launch_server(*args, device=device)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


def launch_server(*args: str, device: str = "cpu") -> ServerProcess:
    """Start `launch_server` on `device` on a free loopback port with `args`, not waiting."""
    port = free_port()
    stderr = tempfile.TemporaryFile("w+", prefix="replaylm-server-")  # noqa: SIM115 (closed by stop)
    cmd = [
        sys.executable,
        "-m",
        "replaylm.launch_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        device,
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    return ServerProcess(proc, port, stderr)
