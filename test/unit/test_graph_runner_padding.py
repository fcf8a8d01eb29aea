"""Graph runners' padding, checked eagerly on the CPU: a live batch copied into the static
buffers and padded up to a captured shape must give the live requests the same logits, and the
padding must touch no live KV slot or request row."""

from __future__ import annotations

import pytest
import torch

from replaylm.compilation.compile_model import TcPiecewiseOptions
from replaylm.model_executor.cuda_graph.backend.breakable import BreakableCudaGraphBackend
from replaylm.model_executor.cuda_graph.backend.factory import create_graph_backend
from replaylm.model_executor.cuda_graph.runner.decode import DecodeCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.prefill import PrefillCudaGraphRunner
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def runner(tiny_qwen3_runner) -> ModelRunner:
    return tiny_qwen3_runner


def _plain(runner: ModelRunner) -> BreakableCudaGraphBackend:
    """A backend whose forward is the model's own (nothing is captured in these tests)."""
    return BreakableCudaGraphBackend(runner.attn_backend)


def _reqs(lens: list[int]) -> list[Req]:
    return [Req(i, [(5 * i + j) % 300 + 3 for j in range(n)], SamplingParams(), 0, 16)
            for i, n in enumerate(lens)]


def _kv_snapshot(runner: ModelRunner, skip: torch.Tensor) -> list[torch.Tensor]:
    """Every KV slot except padding slot 0 and the slots in `skip`."""
    keep = torch.ones(runner.kv_pool.k_buffers[0].shape[0], dtype=torch.bool)
    keep[0] = False
    keep[skip] = False
    return [k[keep].clone() for k in runner.kv_pool.k_buffers]


def test_decode_padding_is_harmless(runner):
    reqs = _reqs([5, 9, 3])
    runner.forward(prepare_extend(reqs, runner))
    for r in reqs:
        r.output_ids.append(7)
    live = prepare_decode(reqs, runner)
    expected = runner.forward(live)
    kv_before = _kv_snapshot(runner, live.out_cache_loc)  # live slots get rewritten
    graph_runner = DecodeCudaGraphRunner(runner, _plain(runner), shapes=[1, 4, 8])
    assert graph_runner.shape_for(3) == 4
    graph_runner.buffers.input_ids.fill_(99)  # stale values the fill must overwrite
    padded = graph_runner.fill(live, 8)
    assert padded.batch_size == 8 and padded.seq_lens_cpu[3:] == [1] * 5
    buf = graph_runner.buffers
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                 "prefix_lens"):
        assert torch.equal(getattr(buf, name)[:3], getattr(live, name))
    assert buf.req_pool_indices[3:8].eq(graph_runner.padding_row).all()
    assert buf.seq_lens[3:8].eq(1).all() and not buf.input_ids[3:8].any()
    assert not buf.out_cache_loc[3:8].any() and not buf.positions[3:8].any()
    runner.attn_backend.init_forward_metadata(padded)
    got = graph_runner.finish(graph_runner.forward_fn(padded), live)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for before, after in zip(kv_before, _kv_snapshot(runner, live.out_cache_loc), strict=True):
        assert torch.equal(before, after)  # padding wrote only slot 0
    assert not runner.req_to_token_pool.req_to_token[graph_runner.padding_row].any()
    again = graph_runner.fill(None, 8)  # all padding now: the same batch object, refilled
    assert again is padded and again.seq_lens_cpu == [1] * 8
    assert buf.req_pool_indices[:8].eq(graph_runner.padding_row).all()
    assert not buf.input_ids[:8].any() and buf.seq_lens[:8].eq(1).all()
    for r in reqs:
        release(r, runner)


def test_prefill_padding_is_harmless(runner):
    reqs = _reqs([6, 11])
    batch = prepare_extend(reqs, runner)
    expected = runner.forward(batch)
    graph_runner = PrefillCudaGraphRunner(runner, _plain(runner), shapes=[16, 32])
    assert graph_runner.shape_for(batch.num_tokens) == 32
    padded = graph_runner.fill(batch, 32)
    assert padded.batch_size == 3 and padded.extend_seq_lens_cpu == [6, 11, 15]
    runner.attn_backend.init_forward_metadata(padded)
    hidden = graph_runner.forward_fn(padded)  # what a prefill graph captures: [bucket, H]
    assert hidden.shape[0] == 32
    got = graph_runner.finish(hidden, batch)  # logits of the live requests, computed after
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    exact = graph_runner.fill(batch, 17)  # bucket met exactly: no padding request
    assert exact.batch_size == 2
    assert graph_runner.fill(batch, 32) is padded  # one batch object per shape, updated
    for r in reqs:
        release(r, runner)


def test_shapes_and_fallback_decisions(runner):
    graph_runner = DecodeCudaGraphRunner(runner, _plain(runner), shapes=[4, 1, 2, 4])
    assert graph_runner.shapes == (1, 2, 4)
    assert [graph_runner.shape_for(k) for k in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    reqs = _reqs([3])
    extend = prepare_extend(reqs, runner)
    assert graph_runner.shape_key(extend) is None  # the decode runner never serves prefill
    release(reqs[0], runner)


def test_factory_errors_are_clear(runner):
    assert create_graph_backend("prefill", "breakable", runner.attn_backend).mode == "breakable"
    for phase in ("decode", "prefill"):
        backend = create_graph_backend(phase, "tc_piecewise", runner.attn_backend,
                                       tc_options=TcPiecewiseOptions("eager", "native"))
        assert backend.mode == "tc_piecewise"
        assert backend.options == TcPiecewiseOptions("eager", "native")
    with pytest.raises(ValueError, match="kernels must be one of fused, native"):
        TcPiecewiseOptions("inductor", "triton")
    with pytest.raises(ValueError, match="'torch_native' has none"):
        create_graph_backend("decode", "full", runner.attn_backend)
    with pytest.raises(ValueError, match="prefill: mode 'full' is not supported"):
        create_graph_backend("prefill", "full", runner.attn_backend)
