"""The guard of the CPU test modules that run Triton kernels through Triton's interpreter."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest


def require_triton_interpreter() -> None:
    """Call at the top of such a module, before importing kernels: skips the whole module
    unless triton is installed and TRITON_INTERPRET=1 (test/conftest.py sets it where there is
    no CUDA GPU; with one, the compiled kernels are tested under test/gpu)."""
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "a CUDA GPU is present: the kernels run compiled (test/gpu)", allow_module_level=True
        )


@contextlib.contextmanager
def scalar_loop_bounds() -> Iterator[None]:
    """Triton 3.6's interpreter turns a loop bound into an int with int() of a 1-element array,
    which NumPy >= 2.4 refuses; inside, it goes through .item() (as later Triton does)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # a Triton without this hook
        yield
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patched)
        yield
