"""The graph-break marker: `@break_point` marks an op that a breakable CUDA graph runs eagerly
between its captured segments (`model_executor/cuda_graph/breakable_graph.py`).

Here, apart from the graph machinery, so a layer can mark its ops without importing the model
executor: the marker only asks the capture that is open on this thread, if any, to run the op.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_state = threading.local()


class BreakingCapture(Protocol):
    """A capture that marked ops break: it ends its current segment, runs the op, begins the
    next segment and returns the op's result."""

    def run_break(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...


def open_capture() -> BreakingCapture | None:
    """The capture open on this thread (None outside one, and while a marked op runs)."""
    return getattr(_state, "capture", None)


def set_open_capture(capture: BreakingCapture | None) -> None:
    """Make `capture` the one marked ops on this thread break (None: marked ops run plainly)."""
    _state.capture = capture


def break_point(fn: F) -> F:
    """Mark `fn` as an op that runs eagerly between graph segments (a no-op outside capture)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        capture = open_capture()
        if capture is None:
            return fn(*args, **kwargs)
        return capture.run_break(fn, args, kwargs)

    return wrapper  # type: ignore[return-value]
