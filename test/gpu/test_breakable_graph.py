"""The BreakableCUDAGraph primitive on plain functions (CUDA)."""

from __future__ import annotations

import pytest
import torch

from replaylm.layers.graph_break import break_point
from replaylm.model_executor.cuda_graph.breakable_graph import BreakableCUDAGraph

pytestmark = pytest.mark.gpu

STREAM = torch.cuda.Stream() if torch.cuda.is_available() else None


@pytest.fixture(autouse=True, scope="module")
def _cublas_ready():
    """One eager matmul first, as every graph user warms up: cuBLAS cannot create its handle
    inside a capture (CUBLAS_STATUS_NOT_INITIALIZED when this file runs first in a process)."""
    if torch.cuda.is_available():
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
        torch.cuda.synchronize()


@break_point
def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


@break_point
def add_into(buf: torch.Tensor, x: torch.Tensor) -> None:
    buf.add_(x)  # mutates an input, returns None (like a KV-cache store)


@break_point
def two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.relu(), softmax_rows(x)  # a nested break point runs plainly


@break_point
def scale_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.mul(x, 2, out=out)  # writes an argument and returns it, as attention_op does


def into_out(x, w, buf):
    h = x @ w
    for _ in range(8):
        h = scale_into(h @ w, torch.empty_like(h)).tanh() + h
    return h.sum(dim=1), buf  # a small output: the breaks' tensors are most of what it holds


def no_break(x, w, buf):
    return (x @ w).tanh()


def one_break(x, w, buf):
    return softmax_rows(x @ w) * 2


def many_breaks(x, w, buf):
    h = x @ w
    for _ in range(5):
        h = softmax_rows(h @ w) + h
        add_into(buf, h[:, :4])
    a, b = two_outputs(h)
    return a + b, buf.sum(dim=0)


def _fresh(shape_rows: int, gen: torch.Generator):
    x = torch.randn(shape_rows, 64, device="cuda", generator=gen)
    return x


@pytest.mark.parametrize(("fn", "breaks"), [(no_break, 0), (one_break, 1), (many_breaks, 11)])
def test_replay_equals_eager_with_fresh_inputs(fn, breaks):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64, 64, device="cuda", generator=gen) / 8
    static_x = _fresh(32, gen)
    static_buf = torch.zeros(32, 4, device="cuda")
    graph = BreakableCUDAGraph(torch.cuda.graph_pool_handle(), torch.cuda.Stream())
    graph.capture(fn, static_x, w, static_buf)
    assert graph.num_breaks == breaks and len(graph.segments) == breaks + 1
    for _ in range(100):
        static_x.copy_(_fresh(32, gen))
        start = torch.randn(32, 4, device="cuda", generator=gen)
        static_buf.copy_(start)
        out = graph.replay()
        ref_buf = start.clone()
        ref = fn(static_x.clone(), w, ref_buf)
        for got, want in zip(
            out if isinstance(out, tuple) else (out,),
            ref if isinstance(ref, tuple) else (ref,),
            strict=True,
        ):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if fn is many_breaks:
            torch.testing.assert_close(static_buf, ref_buf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn", [many_breaks, into_out])
def test_two_shapes_share_one_pool_without_corrupting_each_other(fn):
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    w = torch.randn(64, 64, device="cuda") / 8
    inputs = {n: torch.randn(n, 64, device="cuda") for n in (64, 16)}  # largest first
    bufs = {n: torch.zeros(n, 4, device="cuda") for n in inputs}
    graphs = {}
    for n in inputs:
        graphs[n] = BreakableCUDAGraph(pool, stream)
        graphs[n].capture(fn, inputs[n], w, bufs[n])
    for step in range(20):
        for n in (16, 64) if step % 2 else (64, 16):
            inputs[n].normal_()
            bufs[n].zero_()
            out, _ = graphs[n].replay()
            ref, _ = fn(inputs[n].clone(), w, torch.zeros(n, 4, device="cuda"))
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _pool_bytes(rows: list[int]) -> int:
    """GPU memory that graphs of `into_out` over `rows` (one shape each, one pool, largest
    first) keep reserved once captured, beyond their inputs."""
    w = torch.randn(1024, 1024, device="cuda") / 32
    inputs = [torch.randn(n, 1024, device="cuda") for n in rows]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pool = torch.cuda.graph_pool_handle()
    graphs = [BreakableCUDAGraph(pool, STREAM) for _ in rows]
    for graph, x in zip(graphs, inputs, strict=True):
        graph.capture(into_out, x, w, None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() - before


def test_shapes_reuse_the_tensors_crossing_their_breaks():
    # a shape's 8 breaks cross 16 tensors of rows x 4 KiB: 64 MiB at 1,024 rows; kept per
    # shape, four shapes would hold 2.5 times that
    largest = _pool_bytes([1024])
    assert _pool_bytes([1024, 768, 512, 256]) < 1.2 * largest


def _capture_and_reset(x, w, buf) -> int:
    """Capture, replay and reset a graph; return the bytes allocated while it was alive."""
    graph = BreakableCUDAGraph(torch.cuda.graph_pool_handle(), STREAM)
    graph.capture(many_breaks, x, w, buf)
    graph.replay()
    torch.cuda.synchronize()
    alive = torch.cuda.memory_allocated()
    graph.reset()
    del graph
    torch.cuda.synchronize()
    return alive


def test_reset_releases_memory():
    w = torch.randn(256, 256, device="cuda")
    x = torch.randn(1024, 256, device="cuda")
    buf = torch.zeros(1024, 4, device="cuda")
    _capture_and_reset(x, w, buf)  # first use of the stream allocates cuBLAS's workspace once
    before = torch.cuda.memory_allocated()
    alive = _capture_and_reset(x, w, buf)
    assert alive > before  # the graph held its static results
    assert torch.cuda.memory_allocated() == before
