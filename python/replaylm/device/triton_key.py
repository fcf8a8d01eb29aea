"""Triton's cache key of its own installation, computed on a thread while the model loads.

The first kernel a process compiles, or loads from Triton's disk cache, first hashes Triton itself
(its compiler's sources and libtriton, hundreds of MB: a visible part of a server's start), once
per process. hashlib releases the GIL while it hashes, so a thread started early (a
scheduler process: beside its imports; the Engine: when its model runner starts) does this
beside other work, and the first capture finds the key memoized
(`triton.runtime.cache.triton_key` is an lru_cache, which does not lock: a second thread would
hash again, so one thread per process).
"""

from __future__ import annotations

import importlib.util
import threading

_thread: threading.Thread | None = None


def hash_triton_in_background() -> threading.Thread | None:
    """Start computing Triton's cache key on a daemon thread, the process's first call only (later
    calls return the same thread); None without triton."""
    global _thread
    if _thread is None and importlib.util.find_spec("triton") is not None:
        _thread = threading.Thread(target=_triton_key, name="triton-key", daemon=True)
        _thread.start()
    return _thread


def _triton_key() -> None:
    from triton.runtime.cache import triton_key

    triton_key()
