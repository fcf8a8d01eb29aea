"""Tensor parallelism on several GPUs (NCCL, one GPU per rank): Qwen3-0.6B's shapes with dummy
weights (16 heads and 8 KV heads divide by 2 and 4), under the three graph-mode pairs.

- Logits of TP=2 and TP=4 (where the machine has 4 GPUs) equal TP=1's within bfloat16 noise, on
  a ragged prefill and decode steps that run the captured graphs, all-reduces inside them; also
  with `--tp-all-reduce one-shot`, whose fused sum + add + norm equals the ranks' inputs added
  in rank order in float32 followed by the norm kernel, eagerly and in a graph, with the same
  bits on every rank (NCCL's ring rounds to bfloat16 between hops, ~1% apart at TP=4).
- Greedy generations of an Engine with `tp_size` 2 and 4 equal TP=1's. In float32, so that the
  all-reduce's other summation order cannot flip a token: a divergence is allowed only where
  TP=1's top-2 logits tie within float32 noise. The Engine shuts down (graphs that captured
  NCCL's collectives are freed first, or the group's teardown would hang).
- Engines of TP 2 started one after another in one process: the second takes NCCL's sums where
  the first met its peers over peer memory (torch's symmetric memory meets them once per
  process), and asking one-shot then is an error naming the field.

Skipped on a machine with one GPU.
"""

from __future__ import annotations

import functools
import gc
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from replaylm.distributed.parallel_state import TPGroup, init_tensor_parallel
from replaylm.entrypoints.engine import Engine
from replaylm.layers.kernels.peer_sum_norm import peer_sum_add_rms_norm
from replaylm.layers.kernels.rmsnorm import rms_norm
from replaylm.server_args import ServerArgs

from model_parity import divergence_gaps, rel_error
from tp_ranks import run_ranks, runner_logits

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="tensor parallelism on CUDA needs 2 GPUs"),
]

CONFIG = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "qwen3-0.6b.json"
TP_SIZES = [n for n in (2, 4) if n <= GPUS]
MODES = [
    {"decode": "full", "prefill": "breakable"},
    {"decode": "breakable", "prefill": "breakable"},
    {"decode": "tc_piecewise", "prefill": "tc_piecewise"},
]
REL_TOL = 2e-2  # bfloat16 logits, as test_dummy_qwen3_cuda.py holds bf16 to fp32
FP32_TIE = 1e-2  # a top-2 gap this small is a tie at float32 noise (typical gaps: ~0.1)

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 150000) for _ in range(_rng.randrange(4, 300))] for _ in range(32)]
GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}


def _args(
    modes: dict[str, str], dtype: str, tp_size: int = 1, all_reduce: str = "nccl"
) -> ServerArgs:
    return ServerArgs(
        model_path=str(CONFIG),
        load_format="dummy",
        device="cuda",
        dtype=dtype,
        tp_size=tp_size,
        tp_all_reduce=all_reduce,
        cuda_graph_mode=json.dumps(modes),
        decode_cuda_graph_bs=[1, 2, 4, 8, 16, 32],
        prefill_cuda_graph_tokens=[64, 128, 256, 512],
        chunked_prefill_size=512,
        max_total_tokens=16384,
        max_running_requests=32,
        context_length=1024,
    )


def _name(modes: dict[str, str]) -> str:
    return f"{modes['decode']}-{modes['prefill']}"


def _generate(args: ServerArgs) -> tuple[Engine, list[list[int]]]:
    engine = Engine(**vars(args))
    out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    stats = engine.runner.forward_stats.phases
    assert stats["prefill"].graph > 0 and stats["decode"].graph > 0
    return engine, [o["output_ids"] for o in out]


def _runs(modes: dict[str, str]) -> list[tuple[int, str]]:
    """(TP, all-reduce) of the greedy comparison under `modes`: every size over NCCL, and for
    the default modes the largest over the one-shot kernel too (compiled pieces use NCCL)."""
    runs = [(tp_size, "nccl") for tp_size in TP_SIZES]
    return runs + [(n, "one-shot") for n in TP_SIZES[-1:]] if modes == MODES[0] else runs


@pytest.mark.parametrize("modes", MODES, ids=_name)
def test_greedy_generations_match_one_rank(modes):
    one_rank, want = _generate(_args(modes, "float32"))
    try:
        for tp_size, all_reduce in _runs(modes):
            engine, got = _generate(_args(modes, "float32", tp_size, all_reduce))
            engine.shutdown()
            del engine
            gc.collect()
            gaps = divergence_gaps(one_rank.runner, PROMPTS, got, want)
            run = f"{_name(modes)} {all_reduce} TP={tp_size}"
            print(f"{run}: {len(gaps)} of {len(PROMPTS)} diverge: {gaps}")
            assert all(gap <= FP32_TIE for gap in gaps.values()), (run, gaps)
    finally:
        del one_rank
        gc.collect()
        torch.cuda.empty_cache()


@functools.cache
def _one_rank_logits(modes: str) -> list[np.ndarray]:
    return run_ranks(runner_logits, _args(json.loads(modes), "bfloat16"))


@pytest.mark.parametrize(
    ("modes", "tp_size", "all_reduce"),
    # one-shot at the largest size, where tc_piecewise's compiled pieces would use NCCL anyway
    [(modes, tp_size, "nccl") for modes in MODES for tp_size in TP_SIZES]
    + [(modes, n, "one-shot") for modes in MODES[:2] for n in TP_SIZES[-1:]],
    ids=lambda v: _name(v) if isinstance(v, dict) else str(v),
)
def test_logits_match_one_rank(modes, tp_size, all_reduce):
    ref = _one_rank_logits(json.dumps(modes))
    ours = run_ranks(runner_logits, _args(modes, "bfloat16", tp_size, all_reduce))
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        err = rel_error(torch.from_numpy(a), torch.from_numpy(b))
        print(f"{_name(modes)} {all_reduce} TP={tp_size} step {step}: relative error {err:.2e}")
        assert err < REL_TOL, step


# (rows, columns) of the bfloat16 sums compared; the last is over the one-shot kernel's 512 KiB
SUM_CASES = [(1, 4096), (64, 4096), (7, 1024), (512, 4096)]
SITES = 6  # calls per captured graph, alternating slots as a model's sums do


def _fused_vs_reference(args: ServerArgs, rank: int) -> list[tuple[float, float, bool] | None]:
    """Per SUM_CASES: the one-shot sum + add + norm (eager, then SITES calls replayed from a CUDA
    graph on new inputs) against the ranks' inputs added in rank order in float32, rounded, then
    the RMSNorm kernel: the largest difference relative to the largest entry (the kernel's
    contract: 0), NCCL's all-reduce + norm's difference from the same reference (its ring rounds
    between hops, so only for comparison), and whether every rank got the same bits; None where
    the one-shot kernel does not take the message."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    assert args.dist_init_addr is not None
    group = init_tensor_parallel(
        rank, args.tp_size, args.dist_init_addr, device, one_shot_dtype=torch.bfloat16
    )
    assert group.peer_all_reduce is not None
    return [_fused_case(group, rows, cols) for rows, cols in SUM_CASES]


def _rank_order_sum(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.place.size)]
    dist.all_gather(parts, x, group=group.device_group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part.float()
    return total.to(x.dtype)


def _largest_difference(
    gots: list[tuple[torch.Tensor, torch.Tensor]], wants: list[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    worst = 0.0
    for got, want in zip(gots, wants, strict=True):
        for a, b in zip(got, want, strict=True):
            worst = max(worst, float((a.float() - b.float()).abs().max() / b.float().abs().max()))
    return worst


def _fused_case(group: TPGroup, rows: int, cols: int) -> tuple[float, float, bool] | None:
    peer = group.peer_all_reduce
    assert peer is not None
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device).manual_seed(group.place.rank)
    shared = torch.Generator(device).manual_seed(1234)  # the residual: the same on every rank
    xs = torch.empty(SITES, rows, cols, device=device, dtype=torch.bfloat16)
    rs = torch.empty_like(xs)
    weight = torch.rand(cols, device=device, generator=shared).to(torch.bfloat16) + 0.5
    if not peer.takes(xs[0], rs[0]):
        return None

    def refill() -> None:
        xs.copy_(torch.randn(xs.shape, device=device, generator=gen))
        xs[:, :, :8] = -0.0  # the empty mark's bits, sent as +0.0
        rs.copy_(torch.randn(rs.shape, device=device, generator=shared))

    def calls() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [peer_sum_add_rms_norm(peer, xs[i], rs[i], weight, 1e-6, i) for i in range(SITES)]

    refill()
    calls()  # warm-up (compiles) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls()
    worst, nccl_worst, same = 0.0, 0.0, True
    for _ in range(3):
        refill()
        summed = _rank_order_sum(xs, group)
        wants = [rms_norm(summed[i], weight, 1e-6, rs[i]) for i in range(SITES)]
        nccl_summed = xs.clone()
        dist.all_reduce(nccl_summed, group=group.device_group)
        nccl_gots = [rms_norm(nccl_summed[i], weight, 1e-6, rs[i]) for i in range(SITES)]
        nccl_worst = max(nccl_worst, _largest_difference(nccl_gots, wants))
        graph.replay()
        for gots in (calls(), captured):
            worst = max(worst, _largest_difference(gots, wants))
            for got in gots:
                parts = [torch.empty_like(got[0]) for _ in range(group.place.size)]
                dist.all_gather(parts, got[0], group=group.device_group)
                same &= all(torch.equal(p, parts[0]) for p in parts)
    graph.reset()
    return worst, nccl_worst, same


def test_one_shot_sum_norm_equals_rank_order_sum_then_norm():
    """Eager and captured, on every size of group the machine has; a message over the kernel's
    limit is not taken (NCCL sums it)."""
    for tp_size in TP_SIZES:
        results = run_ranks(_fused_vs_reference, _args(MODES[0], "bfloat16", tp_size))
        print(f"TP={tp_size}: (one-shot, NCCL: difference from the reference; same bits) {results}")
        assert results[-1] is None  # 4 MiB: left to NCCL
        assert all(r is not None and r[0] == 0.0 and r[2] for r in results[:-1]), results


# Engines of TP 2 one after another in one process, then one asking for one-shot: what each used
_SEQUENTIAL_ENGINES = """
import json, sys
from replaylm.entrypoints.engine import Engine

def engine(**kw):
    return Engine(model_path=sys.argv[1], load_format="dummy", device="cuda", dtype="bfloat16",
                  tp_size=2, max_total_tokens=4096, max_running_requests=4, context_length=512,
                  decode_cuda_graph_bs=[1, 2, 4], prefill_cuda_graph_tokens=[64], **kw)

runs = []
for _ in range(2):
    e = engine()
    out = e.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4,
                                                             "ignore_eos": True})
    runs.append([e.server_args.tp_all_reduce, len(out[0]["output_ids"])])
    e.shutdown()
try:
    engine(tp_all_reduce="one-shot")
    runs.append("started")
except ValueError as err:
    runs.append(str(err))
print(json.dumps(runs))
"""


def test_an_engine_process_starts_groups_one_after_another():
    """The offline Engine's process is rank 0 of every group it starts, and torch's symmetric
    memory meets peers once per process: the second Engine of TP 2 takes NCCL's sums (auto) and
    generates instead of waiting forever for the peer buffer's rendezvous; asking one-shot then
    is an error naming the field. In a child process, so that this one's peers stay unmet."""
    child = subprocess.run(
        [sys.executable, "-c", _SEQUENTIAL_ENGINES, str(CONFIG)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    first, second, third = json.loads(child.stdout.strip().splitlines()[-1])
    assert first == ["auto", 4] and second == ["nccl", 4]
    assert third.startswith("tp_all_reduce: 'one-shot' can serve one"), third
