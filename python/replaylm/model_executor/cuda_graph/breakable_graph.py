"""BreakableCUDAGraph: capture a callable as a chain of CUDA graphs broken at marked ops.

Mark an op with `@break_point` (`layers/graph_break.py`). Outside a capture the mark does
nothing. While a BreakableCUDAGraph captures, calling a marked op ends the current graph segment,
runs the op eagerly once (its tensor arguments are static tensors of the previous segment), keeps
its result as a static tensor that the next segment reads, and begins the next segment. Replay
runs segment, op, segment, ... where each op is called again with the same arguments and its
fresh result is copied into the static result in place. A marked op called inside another marked
op runs plainly (no nested segments).

All segments are captured into the memory pool the caller gives (shared by every shape of a
runner); tensors a later segment reads stay valid because replay follows capture order. The op's
tensor arguments (and a result that is one of them) are kept by address only, as a full graph
keeps its intermediates: after the capture the pool may hand their memory to other shapes, since
every replay writes them (segment) before it reads them (op). A result the op allocates itself
stays owned. So the shapes' graphs hold about what the largest one's intermediates take, not
every break's tensors per shape (Llama-3.1-8B's prefill buckets: 424 MiB, against 9 GiB). With
`eager=True` nothing is captured: `replay` calls the function eagerly through the same code path
(the debug switch, to bisect wrong outputs).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replaylm.layers.graph_break import open_capture, set_open_capture

# an integer type of each element size: the array interface has no bfloat16
_SAME_SIZE_INT = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _DeviceArray:
    """A CUDA tensor's memory by address only (`__cuda_array_interface__`): a tensor built on it
    keeps this object alive, not the memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "strides": tuple(s * tensor.element_size() for s in tensor.stride()),
            "typestr": _SAME_SIZE_INT[tensor.element_size()],
            "data": (tensor.data_ptr(), False),
            "version": 2,
        }


def _unowned(value: Any) -> Any:
    """`value` with each CUDA tensor in it (nested in tuples, lists and dicts) replaced by an
    alias of the same memory that does not keep it allocated."""
    if isinstance(value, torch.Tensor):
        if not value.is_cuda or value.numel() == 0 or value.element_size() not in _SAME_SIZE_INT:
            return value
        return torch.as_tensor(_DeviceArray(value), device=value.device).view(value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_unowned(v) for v in value)
    if isinstance(value, dict):
        return {k: _unowned(v) for k, v in value.items()}
    return value


def _unowned_if_argument(result: Any, arguments: list[torch.Tensor]) -> Any:
    """`result` with the tensors that are among `arguments` unowned (see `_unowned`)."""
    if isinstance(result, torch.Tensor):
        return _unowned(result) if any(result is a for a in arguments) else result
    if isinstance(result, (tuple, list)):
        return type(result)(_unowned_if_argument(r, arguments) for r in result)
    return result


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in `values` (nested in tuples, lists and dicts)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (tuple, list)):
        return [t for v in values for t in _tensors(v)]
    if isinstance(values, dict):
        return [t for v in values.values() for t in _tensors(v)]
    return []


@dataclass
class _EagerOp:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    result: Any  # the static result the next segment reads


def _copy_into(static: Any, fresh: Any) -> None:
    """Copy `fresh` into `static` (tensors, nested tuples/lists of them, or None)."""
    if isinstance(static, torch.Tensor):
        if fresh is not static:
            static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for s, f in zip(static, fresh, strict=True):
            _copy_into(s, f)
    elif static is not None and static != fresh:
        raise TypeError(
            f"a break-point op returned {type(fresh).__name__}; only tensors, "
            "tuples/lists of tensors and None can cross a graph break"
        )


class BreakableCUDAGraph:
    """One captured shape. `capture(fn, *args)` returns fn's output (static tensors);
    `replay()` recomputes it in place from the current contents of the static inputs."""

    def __init__(
        self, pool: Any = None, stream: torch.cuda.Stream | None = None, eager: bool = False
    ) -> None:
        self.pool = pool
        self.stream = stream
        self.eager = eager
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.ops: list[_EagerOp] = []
        self.output: Any = None
        self._open: torch.cuda.CUDAGraph | None = None
        self._call: tuple[Callable[..., Any], tuple, dict] | None = None

    @property
    def num_breaks(self) -> int:
        return len(self.ops)

    def capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._call = (fn, args, kwargs)
        if self.eager:
            self.output = fn(*args, **kwargs)
            return self.output
        if open_capture() is not None:
            raise RuntimeError("a BreakableCUDAGraph is already capturing on this thread")
        stream = self.stream or torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            self._begin()
            set_open_capture(self)
            try:
                self.output = fn(*args, **kwargs)
            finally:
                set_open_capture(None)
                self._end()
        torch.cuda.current_stream().wait_stream(stream)
        return self.output

    def replay(self) -> Any:
        if self.eager:
            assert self._call is not None, "capture() first"
            fn, args, kwargs = self._call
            _copy_into(self.output, fn(*args, **kwargs))
            return self.output
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(self.ops):
                op = self.ops[i]
                _copy_into(op.result, op.fn(*op.args, **op.kwargs))
        return self.output

    def reset(self) -> None:
        """Free the segments and every static tensor they hold."""
        for segment in self.segments:
            segment.reset()
        self.segments.clear()
        self.ops.clear()
        self.output = None
        self._call = None

    def _begin(self) -> None:
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self.pool)

    def _end(self) -> None:
        assert self._open is not None  # every _end follows a _begin
        self._open.capture_end()
        self.segments.append(self._open)
        self._open = None

    def run_break(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """End the open segment, run the marked op `fn` eagerly, begin the next segment."""
        self._end()
        set_open_capture(None)  # marked ops inside this one run plainly
        try:
            result = fn(*args, **kwargs)
        finally:
            set_open_capture(self)
        arguments = _tensors((args, kwargs))
        static = _unowned_if_argument(result, arguments)
        self.ops.append(_EagerOp(fn, _unowned(args), _unowned(kwargs), static))
        self._begin()
        return result
