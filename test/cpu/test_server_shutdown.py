"""launch_server stops cleanly on SIGINT and SIGTERM: exit code 0, the scheduler process gone."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from server_process import start_server
from tiny_checkpoints import write_tiny_checkpoint


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return bool(state.stdout.strip()) and not state.stdout.strip().startswith("Z")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_server_and_scheduler(tmp_path, sig):
    write_tiny_checkpoint("qwen2", tmp_path)
    server = start_server("--model-path", str(tmp_path), "--max-total-tokens", "256")
    try:
        children = _children(server.proc.pid)
        assert children, "the scheduler child process should be running"
        server.proc.send_signal(sig)
        assert server.proc.wait(60) == 0, server.stderr_tail()
        deadline = time.monotonic() + 30  # the server joined its child; allow a busy machine
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in children)
    finally:
        server.stop()
