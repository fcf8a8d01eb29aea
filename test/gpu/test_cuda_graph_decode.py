"""`full` decode CUDA graphs against eager on the GPU (SmolLM2, bfloat16, triton attention).

- logits: every decode step of live batches 1, 3, 7, 8, 13, 64, 100 (padded up to captured
  shapes) replayed from the graph equal the eager forward of the same batch within bf16 noise;
- generation: greedy outputs through the real scheduler, requests of different lengths joining
  and leaving between steps, equal eager for >= 98% of requests, every divergence at a near-tie;
- a batch larger than the largest captured shape falls back to eager, still correct;
- capturing again after cleanup returns the memory (no leak).
"""

from __future__ import annotations

import pytest
import torch

from replaylm.entrypoints.engine import Engine
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

from model_parity import divergence_gaps, rel_error

pytestmark = pytest.mark.gpu

LIVE_BATCH_SIZES = [1, 3, 7, 8, 13, 64, 100]
NEAR_TIE = 0.5  # logits: top-2 gap under which bf16 noise may flip greedy
TOPICS = [
    "the sea",
    "a robot",
    "Paris",
    "mathematics",
    "a cat",
    "winter",
    "music",
    "a river",
    "the moon",
    "bread",
    "a library",
    "trains",
    "gardens",
    "volcanoes",
    "chess",
    "rain",
]


def _args(**kw) -> ServerArgs:
    base = dict(device="cuda", dtype="bfloat16", max_total_tokens=60000, max_running_requests=128)
    return ServerArgs(**{**base, **kw})


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return load_model_runner(
        resolve_engine_config(_args(decode_cuda_graph_bs=[1, 2, 4, 8, 16, 32, 64, 96, 128]))
    )


def _eager(runner: ModelRunner, batch) -> torch.Tensor:
    runner.attn_backend.init_forward_metadata(batch)
    return runner.model(batch.input_ids, batch.positions, batch)


@pytest.mark.parametrize("bs", LIVE_BATCH_SIZES)
def test_replayed_logits_equal_eager(runner, bs):
    gen = torch.Generator().manual_seed(bs)
    reqs = [
        Req(i, torch.randint(10, 40000, (int(n),), generator=gen).tolist(), SamplingParams(), 0, 16)
        for i, n in enumerate(torch.randint(1, 300, (bs,), generator=gen))
    ]
    logits = runner.forward(prepare_extend(reqs, runner))
    graph_before = runner.forward_stats.phases["decode"].graph
    for _ in range(4):
        for req, token in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            req.output_ids.append(token)
        batch = prepare_decode(reqs, runner)
        logits = runner.forward(batch)  # graph replay
        with torch.inference_mode():
            eager = _eager(runner, batch)
        assert logits.shape == eager.shape == (bs, runner.config.vocab_size)
        assert rel_error(logits, eager) < 1e-2
    assert runner.forward_stats.phases["decode"].graph == graph_before + 4
    for req in reqs:
        release(req, runner.kv)


def test_batch_beyond_the_largest_shape_falls_back_to_eager():
    small = load_model_runner(
        resolve_engine_config(_args(decode_cuda_graph_bs=[1, 2, 4], max_running_requests=8))
    )
    reqs = [Req(i, [100 + i, 200, 300 + i], SamplingParams(), 0, 4) for i in range(6)]
    small.forward(prepare_extend(reqs, small))
    for r in reqs:
        r.output_ids.append(42)
    batch = prepare_decode(reqs, small)
    assert not small.graph_runners["decode"].can_run(batch)
    eager_before = small.forward_stats.phases["decode"].eager
    logits = small.forward(batch)
    assert small.forward_stats.phases["decode"].eager == eager_before + 1
    with torch.inference_mode():
        assert rel_error(logits, _eager(small, batch)) < 1e-3


def test_capture_again_after_cleanup_does_not_leak(runner):
    graphs = runner.graph_runners["decode"]
    torch.cuda.synchronize()
    used_first = torch.cuda.memory_reserved()
    for _ in range(2):
        graphs.cleanup()
        graphs.capture()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= used_first + 64 * 2**20


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    return [
        engine.encode_chat(
            [
                {
                    "role": "user",
                    "content": f"Write {1 + i % 5} sentences about {TOPICS[i % len(TOPICS)]}.",
                }
            ]
        )
        for i in range(n)
    ]


def _run(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Half the requests start at once; the rest join one per step; lengths differ, so requests
    also leave at different steps."""
    sched = engine.scheduler
    reqs = [
        Req(i, p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), 0, n)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    half = len(reqs) // 2
    for req in reqs[:half]:
        sched.add(req)
    for req in reqs[half:]:
        sched.step()
        sched.add(req)
    sched.run_to_completion()
    return [r.output_ids for r in reqs]


def test_greedy_generations_match_eager_through_the_scheduler():
    graph = Engine(**vars(_args(decode_cuda_graph_bs=[1, 2, 4, 8, 16, 32, 64, 96, 128])))
    eager = Engine(**vars(_args(decode_disable_cuda_graph=True)))
    prompts = _prompts(graph, 100)
    lengths = [8 + (7 * i) % 25 for i in range(100)]  # 8..32 tokens
    got, want = _run(graph, prompts, lengths), _run(eager, prompts, lengths)
    assert graph.runner.forward_stats.phases["decode"].graph > 0
    assert eager.runner.forward_stats.phases["decode"].graph == 0
    gaps = divergence_gaps(eager.runner, prompts, got, want)
    print(f"{len(gaps)} of 100 generations diverge; top-2 gaps there: {gaps}")
    assert len(gaps) <= 2
    assert all(g <= NEAR_TIE for g in gaps.values())
