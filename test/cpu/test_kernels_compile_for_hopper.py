"""The decode path's Triton kernels compile for Hopper on this GPU-less machine
(`test/hopper_compile.py`: Triton's front end, passes and ptxas for sm_90), so that code the
interpreter runs but the compiler refuses fails here and not on a GPU's first launch. In a
process of its own: the interpreter switch (test/conftest.py) is read when a kernel is defined."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TEST_DIR = Path(__file__).resolve().parents[1]


def test_the_decode_kernels_compile_for_sm90(tmp_path: Path) -> None:
    triton = pytest.importorskip("triton", reason="triton is not installed")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton has no ptxas to compile for a GPU with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(TEST_DIR.parent / "python"), str(TEST_DIR), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled now, not found in a cache
    done = subprocess.run(
        [sys.executable, str(TEST_DIR / "hopper_compile.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "FAIL" not in done.stdout and " compiled" in done.stdout
