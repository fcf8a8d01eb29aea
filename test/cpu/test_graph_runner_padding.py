"""Graph runners' padding, checked eagerly on the CPU: a live batch copied into (or built in) a
shape's static inputs and padded up to that shape must give the live requests the same logits,
and the padding must touch no live KV slot or request row."""

from __future__ import annotations

import pytest
import torch

from replaylm.compilation.compile_model import TcPiecewiseOptions
from replaylm.cuda_graph_modes import MODE_TRAITS
from replaylm.model_executor.cuda_graph.backend.breakable import BreakableCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.factory import GRAPH_BACKENDS, create_graph_backend
from replaylm.model_executor.cuda_graph.config import GraphBackendOptions
from replaylm.model_executor.cuda_graph.runner.base import RunnerContext
from replaylm.model_executor.cuda_graph.runner.decode import DecodeCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.prefill import PrefillCudaGraphRunner
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def runner(tiny_qwen3_runner) -> ModelRunner:
    return tiny_qwen3_runner


def _context(runner: ModelRunner) -> RunnerContext:
    return RunnerContext(runner.model, runner.kv, runner.attn_backend)


def _plain(runner: ModelRunner) -> BreakableCudaGraphBackend:
    """A backend whose forward is the model's own (nothing is captured in these tests)."""
    return BreakableCudaGraphBackend(runner.attn_backend)


def _reqs(lens: list[int]) -> list[Req]:
    return [
        Req(i, [(5 * i + j) % 300 + 3 for j in range(n)], SamplingParams(), 0, 16)
        for i, n in enumerate(lens)
    ]


def _kv_snapshot(runner: ModelRunner, skip: torch.Tensor) -> list[torch.Tensor]:
    """Every KV slot except padding slot 0 and the slots in `skip`."""
    keep = torch.ones(runner.kv.pool.k_buffers[0].shape[0], dtype=torch.bool)
    keep[0] = False
    keep[skip] = False
    return [k[keep].clone() for k in runner.kv.pool.k_buffers]


_COPIED = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens")


def _assert_padded(graph_runner: DecodeCudaGraphRunner, padded, live, shape: int) -> None:
    """`padded` views `shape`'s inputs: the live requests' fields, then padding requests."""
    inputs, n = graph_runner.inputs[shape], live.batch_size
    assert padded.batch_size == shape and padded.input_ids is inputs.field("input_ids")
    assert padded.seq_lens_cpu == live.seq_lens_cpu + [1] * (shape - n)
    for name in _COPIED:
        assert torch.equal(inputs.field(name)[:n], getattr(live, name))
    assert inputs.field("req_pool_indices")[n:shape].eq(graph_runner.padding_row).all()
    assert inputs.field("seq_lens")[n:].eq(1).all()
    for name in ("input_ids", "positions", "out_cache_loc", "prefix_lens"):
        assert not inputs.field(name)[n:].any()
    assert padded.extend_seq_lens.eq(1).all()
    assert torch.equal(padded.extend_start_loc, torch.arange(shape))


def _decode_step(runner: ModelRunner, lens: list[int]):
    """Requests of `lens` prompt tokens, prefilled, with a decode batch built eagerly."""
    reqs = _reqs(lens)
    runner.forward(prepare_extend(reqs, runner))
    for r in reqs:
        r.output_ids.append(7)
    return reqs, prepare_decode(reqs, runner)


def test_decode_padding_is_harmless(runner):
    """A batch built elsewhere is copied into the shape's inputs and padded."""
    reqs, live = _decode_step(runner, [5, 9, 3])
    expected = runner.forward(live)
    kv_before = _kv_snapshot(runner, live.out_cache_loc)  # live slots get rewritten
    graph_runner = DecodeCudaGraphRunner(_context(runner), _plain(runner), shapes=[1, 4, 8])
    assert graph_runner.shape_for(3) == 4
    graph_runner.inputs[8].field("input_ids").fill_(99)  # stale values the fill must overwrite
    padded = graph_runner.fill(live, 8)
    _assert_padded(graph_runner, padded, live, 8)
    runner.attn_backend.init_forward_metadata(padded)
    got = graph_runner.finish(graph_runner.forward_fn(padded), live)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for before, after in zip(kv_before, _kv_snapshot(runner, live.out_cache_loc), strict=True):
        assert torch.equal(before, after)  # padding wrote only slot 0
    assert not runner.kv.req_to_token.req_to_token[graph_runner.padding_row].any()
    again = graph_runner.fill(None, 8)  # all padding now: the same batch object, refilled
    assert again is padded and again.seq_lens_cpu == [1] * 8
    inputs = graph_runner.inputs[8]
    assert inputs.field("req_pool_indices").eq(graph_runner.padding_row).all()
    assert not inputs.field("input_ids").any() and inputs.field("seq_lens").eq(1).all()
    for r in reqs:
        release(r, runner.kv)


def test_decode_batch_built_in_the_graphs_inputs_is_replayed_without_a_copy(runner):
    """`ForwardBatch.create(into=...)` packs a decode batch, padded, straight into the inputs
    of the shape that replays it: the same values as the batch built elsewhere, the same logits,
    the table's padding row untouched, and `fill` copies nothing."""
    reqs, eager = _decode_step(runner, [4, 11, 6])
    expected = runner.forward(eager)
    graph_runner = DecodeCudaGraphRunner(_context(runner), _plain(runner), shapes=[1, 4, 8])
    into = graph_runner.inputs_for(ForwardMode.DECODE, 3, 3)
    assert into is graph_runner.inputs[4]
    assert graph_runner.inputs_for(ForwardMode.DECODE, 9, 9) is None
    assert graph_runner.inputs_for(ForwardMode.DECODE, 0, 0) is None
    built = ForwardBatch.create(
        ForwardMode.DECODE,
        [[r.last_id] for r in reqs],
        [r.kv_len - 1 for r in reqs],
        [r.req_pool_idx for r in reqs],
        eager.out_cache_loc.tolist(),
        runner.kv,
        runner.attn_backend,
        into=into,
    )
    assert built.batch_size == 3 and into.holds(built.input_ids)
    assert built.seq_lens_cpu == eager.seq_lens_cpu
    # a marker in the padding request's length: a fill that copied would overwrite it with 1
    seq_lens = into.field("seq_lens")
    seq_lens[3] = 7
    padded = graph_runner.fill(built, 4)
    assert int(seq_lens[3]) == 7  # nothing was copied: the batch is already there
    assert graph_runner.fill(eager, 4) is padded  # a batch built elsewhere is copied in,
    _assert_padded(graph_runner, padded, eager, 4)  # padding included
    assert not runner.kv.req_to_token.req_to_token[graph_runner.padding_row].any()
    runner.attn_backend.init_forward_metadata(padded)
    got = graph_runner.finish(graph_runner.forward_fn(padded), built)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="graph inputs of 4 tokens cannot hold 5"):
        ForwardBatch.create(
            ForwardMode.DECODE,
            [[1]] * 5,
            [0] * 5,
            [0] * 5,
            [1] * 5,
            runner.kv,
            runner.attn_backend,
            into=into,
        )
    for r in reqs:
        release(r, runner.kv)


def test_prefill_padding_is_harmless(runner):
    reqs = _reqs([6, 11])
    batch = prepare_extend(reqs, runner)
    expected = runner.forward(batch)
    graph_runner = PrefillCudaGraphRunner(_context(runner), _plain(runner), shapes=[16, 32])
    assert graph_runner.shape_for(batch.num_tokens) == 32
    padded = graph_runner.fill(batch, 32)
    assert padded.batch_size == 3 and padded.extend_seq_lens_cpu == [6, 11, 15]
    runner.attn_backend.init_forward_metadata(padded)
    hidden = graph_runner.forward_fn(padded)  # what a prefill graph captures: [bucket, H]
    assert hidden.shape[0] == 32
    got = graph_runner.finish(hidden, batch)  # logits of the live requests, computed after
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    exact = PrefillCudaGraphRunner(_context(runner), _plain(runner), shapes=[17])
    assert exact.fill(batch, 17).batch_size == 2  # bucket met exactly: no padding request
    assert graph_runner.fill(batch, 32) is padded  # one batch object per shape, updated
    for r in reqs:
        release(r, runner.kv)


def test_prefill_buckets_above_the_context_length_pad_with_several_requests(tmp_path):
    """A bucket of 48 tokens over a context of 16: two live requests (22 tokens) and padding
    requests of at most 16 tokens each, whose positions and request-table reads stay inside the
    context; the live logits are unchanged."""
    write_tiny_checkpoint("qwen3", tmp_path)
    short = load_model_runner(
        resolve_engine_config(
            ServerArgs(
                model_path=str(tmp_path),
                device="cpu",
                max_total_tokens=256,
                max_running_requests=4,
                context_length=16,
            )
        )
    )
    reqs = _reqs([10, 12])
    batch = prepare_extend(reqs, short)
    expected = short.forward(batch)
    graph_runner = PrefillCudaGraphRunner(_context(short), _plain(short), shapes=[16, 48])
    assert graph_runner.shape_requests(48) == 4 + 3  # the running requests, and 48 / 16 padding
    padded = graph_runner.fill(batch, 48)
    assert padded.extend_seq_lens_cpu == [10, 12, 16, 10]
    assert int(padded.positions.max()) == 15
    short.attn_backend.init_forward_metadata(padded)
    got = graph_runner.finish(graph_runner.forward_fn(padded), batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for r in reqs:
        release(r, short.kv)
    most = _reqs([12, 12, 12, 12])  # as many requests as may run: a bucket still serves them
    assert graph_runner.can_run(full := prepare_extend(most, short))
    assert graph_runner.fill(full, 48).extend_seq_lens_cpu == [12] * 4
    for r in most:
        release(r, short.kv)


def test_shapes_and_fallback_decisions(runner):
    graph_runner = DecodeCudaGraphRunner(_context(runner), _plain(runner), shapes=[4, 1, 2, 4])
    assert graph_runner.shapes == (1, 2, 4)
    assert [graph_runner.shape_for(k) for k in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    reqs = _reqs([3])
    extend = prepare_extend(reqs, runner)
    # the decode runner never serves prefill
    assert graph_runner.shape_key(extend.forward_mode, 1, 3) is None
    assert not graph_runner.can_run(extend)
    release(reqs[0], runner.kv)


def test_the_factory_has_one_backend_per_row_of_the_mode_traits():
    assert list(GRAPH_BACKENDS) == list(MODE_TRAITS)
    assert all(backend.mode == mode for mode, backend in GRAPH_BACKENDS.items())


def test_the_factory_reads_each_backends_options_from_the_resolved_config(runner):
    args = ServerArgs(
        device="cpu",
        debug_cuda_graph=True,
        tc_piecewise_compiler="eager",
        tc_piecewise_kernels="native",
        cuda_graph_mode='{"decode": "breakable", "prefill": "breakable"}',
    )
    options = resolve_engine_config(args).cuda_graphs.options
    breakable = create_graph_backend("prefill", "breakable", runner.attn_backend, options)
    assert isinstance(breakable, BreakableCudaGraphBackend) and breakable.debug
    for phase in ("decode", "prefill"):
        backend = create_graph_backend(phase, "tc_piecewise", runner.attn_backend, options)
        assert backend.mode == "tc_piecewise" and backend.debug
        assert backend.options == TcPiecewiseOptions("eager", "native")
    plain = GraphBackendOptions()
    assert not create_graph_backend("decode", "breakable", runner.attn_backend, plain).debug


def test_factory_errors_are_clear(runner):
    args = GraphBackendOptions()
    with pytest.raises(ValueError, match="kernels must be one of fused, native"):
        TcPiecewiseOptions("inductor", "triton")
    with pytest.raises(ValueError, match="'torch_native' has none"):
        create_graph_backend("decode", "full", runner.attn_backend, args)
    # the mode traits' rule, the same words the resolver gives
    with pytest.raises(ValueError, match="prefill mode 'full' is not supported yet; use "):
        create_graph_backend("prefill", "full", runner.attn_backend, args)
    with pytest.raises(ValueError, match="decode: no CUDA-graph backend for mode 'disabled'"):
        create_graph_backend("decode", "disabled", runner.attn_backend, args)
