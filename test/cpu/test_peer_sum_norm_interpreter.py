"""The one-shot sum + add + RMSNorm kernel of `--tp-all-reduce one-shot` on the CPU: one process
per rank runs it through Triton's interpreter over buffers in shared memory (each rank writes
into every rank's buffer and polls its own, as over NVLink on GPUs).

Over a run of calls with changing row counts and alternating slots: every rank gets the same
bits, the sum matches the ranks' inputs added in rank order and the norm matches the RMSNorm
kernel, inputs of -0.0 (the empty mark's bits) sum as zeros, and every buffer is marked empty
again at the end."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

from replaylm.distributed.peer_all_reduce import EMPTY_MARK, mark_empty  # noqa: E402
from replaylm.layers.kernels.peer_sum_norm import launch_peer_sum_norm  # noqa: E402
from replaylm.layers.kernels.rmsnorm import rms_norm  # noqa: E402

WIDTH = 48  # not a power of two: the last lanes are masked
ROWS = [1, 3, 2, 5, 1, 4]  # one call each, slots alternating
REGION = 8 * WIDTH  # elements per rank and slot
PROGRAMS = 2  # fewer than the rows of some calls: a program sends and sums several rows
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _inputs(rank: int, call: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s partial sums for `call` (a few -0.0 among them), and the residual (the
    same on every rank)."""
    x = torch.randn(ROWS[call], WIDTH, generator=torch.Generator().manual_seed(100 * call + rank))
    x[:, :3] = -0.0
    residual = torch.randn(ROWS[call], WIDTH, generator=torch.Generator().manual_seed(call))
    return x.to(dtype), residual.to(dtype)


def _weight(dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, WIDTH).to(dtype)


def _rank(rank: int, buffers: dict[torch.dtype, list[torch.Tensor]], results: Any) -> None:
    """Every call of every dtype as rank `rank`; the outputs go back as float32 arrays."""
    outputs = {}
    with scalar_loop_bounds():
        for dtype, ranks_buffers in buffers.items():
            slot_bytes = len(ranks_buffers) * REGION * dtype.itemsize
            calls = []
            for call in range(len(ROWS)):
                regions = torch.tensor(
                    [b.data_ptr() + call % 2 * slot_bytes for b in ranks_buffers],
                    dtype=torch.int64,
                )
                x, residual = _inputs(rank, call, dtype)
                out, res = launch_peer_sum_norm(
                    x, residual, _weight(dtype), EPS, regions, REGION, rank, PROGRAMS
                )
                calls.append((out.float().numpy(), res.float().numpy()))
            outputs[str(dtype)] = calls
    results.put((rank, outputs))


def _run(ranks: int) -> tuple[dict[int, Any], dict[torch.dtype, list[torch.Tensor]]]:
    buffers = {
        dtype: [torch.empty(2 * ranks * REGION, dtype=dtype).share_memory_() for _ in range(ranks)]
        for dtype in DTYPES
    }
    for dtype, ranks_buffers in buffers.items():
        for b in ranks_buffers:
            mark_empty(b, dtype.itemsize)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, buffers, results)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        outputs = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return outputs, buffers


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_gets_the_sum_added_and_normed(ranks):
    outputs, buffers = _run(ranks)
    for dtype in DTYPES:
        for call in range(len(ROWS)):
            got = [outputs[r][str(dtype)][call] for r in range(ranks)]
            for out, res in got[1:]:
                assert np.array_equal(out, got[0][0]) and np.array_equal(res, got[0][1])
            total = torch.zeros(ROWS[call], WIDTH)
            for r in range(ranks):
                total += _inputs(r, call, dtype)[0].float()
            residual = _inputs(0, call, dtype)[1]
            want_out, want_res = rms_norm(total.to(dtype), _weight(dtype), EPS, residual)
            out, res = (torch.from_numpy(a) for a in got[0])
            if dtype == torch.bfloat16:  # the interpreter rounds bfloat16 its own way: an ulp
                torch.testing.assert_close(res, want_res.float(), rtol=2e-2, atol=5e-2)
                torch.testing.assert_close(out, want_out.float(), rtol=2e-2, atol=5e-2)
            else:
                assert torch.equal(res, want_res.float()), (dtype, call)
                assert torch.equal(out, want_out.float()), (dtype, call)
        width = dtype.itemsize
        marks = {2: torch.int16, 4: torch.int32}[width]
        for b in buffers[dtype]:
            assert bool((b.view(marks) == EMPTY_MARK[width]).all()), "a buffer was left unmarked"
