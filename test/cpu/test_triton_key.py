"""Triton's cache key computed on a thread (`device/triton_key.py`)."""

from __future__ import annotations

import pytest

from replaylm.device import triton_key
from replaylm.device.triton_key import hash_triton_in_background


def test_the_thread_leaves_the_key_memoized(monkeypatch):
    cache = pytest.importorskip("triton.runtime.cache")
    cache.triton_key.cache_clear()
    monkeypatch.setattr(triton_key, "_thread", None)  # as in a fresh process
    thread = hash_triton_in_background()
    assert thread is not None and thread.daemon
    assert hash_triton_in_background() is thread  # one per process
    thread.join(timeout=60)
    assert cache.triton_key.cache_info().currsize == 1
    hits = cache.triton_key.cache_info().hits
    key = cache.triton_key()
    assert cache.triton_key.cache_info().hits == hits + 1 and key.startswith(cache.__version__)
