"""The break-point mark and the breakable graph's eager debug path, on the CPU (capture itself
needs CUDA: test/gpu/test_breakable_graph.py)."""

from __future__ import annotations

import torch

from replaylm.layers.graph_break import break_point
from replaylm.model_executor.cuda_graph.breakable_graph import BreakableCUDAGraph

CALLS: list[str] = []


@break_point
def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    CALLS.append("scale")
    return x * factor


@break_point
def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[: len(x) // 2] + 0, scale(x[len(x) // 2 :], 3.0)  # nested break point


def model(x: torch.Tensor) -> torch.Tensor:
    a, b = split(torch.sin(x))
    return scale(a, 2.0).sum() + b.sum()


def test_break_point_is_a_plain_call_outside_capture():
    CALLS.clear()
    x = torch.randn(6)
    assert torch.equal(scale(x, 2.0), x * 2.0)
    assert CALLS == ["scale"]
    assert scale.__name__ == "scale" and scale.__wrapped__(x, 1.0).equal(x)


def test_debug_mode_replays_eagerly_from_the_static_inputs():
    static_x = torch.randn(8)
    graph = BreakableCUDAGraph(eager=True)
    out = graph.capture(model, static_x)
    torch.testing.assert_close(out, model(static_x))
    for _ in range(3):
        static_x.copy_(torch.randn(8))
        replayed = graph.replay()
        assert replayed is out  # results land in the same static output
        torch.testing.assert_close(replayed, model(static_x))
    assert graph.segments == [] and graph.num_breaks == 0  # nothing captured
