"""The guard of the CPU test modules that run Triton kernels through Triton's interpreter."""

from __future__ import annotations

import os

import pytest


def require_triton_interpreter() -> None:
    """Call at the top of such a module, before importing kernels: skips the whole module
    unless triton is installed and TRITON_INTERPRET=1 (test/conftest.py sets it where there is
    no CUDA GPU; with one, the compiled kernels are tested under test/gpu)."""
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA GPU is present: the kernels run compiled (test/gpu)",
                    allow_module_level=True)
