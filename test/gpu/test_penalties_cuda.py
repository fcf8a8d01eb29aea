"""Penalties, logit_bias and min_tokens on CUDA: the adjustments of a batch over a real-size
vocabulary (the Triton penalties kernel) equal the torch reference bit for bit, and the built-in
SmolLM2 served with full decode CUDA graphs adjusts every sampled row as the reference says, with
the same tokens with the overlap schedule and without, and plain requests untouched by penalised
companions (`--deterministic`: a request's tokens do not depend on its batch)."""

from __future__ import annotations

import json

import pytest
import torch

from replaylm.entrypoints.engine import Engine
from replaylm.layers import kernels
from replaylm.layers.logit_adjust import LogitAdjuster
from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams

from penalty_reference import check_against_reference, record_sampling, reference_logits

pytestmark = pytest.mark.gpu

VOCAB = 151936  # Qwen3's
TOPICS = ["the sea", "a robot", "Paris", "winter", "music", "a river"]
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
PARAMS = [
    {**GREEDY, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    {**GREEDY},  # plain
    {**SAMPLED, "repetition_penalty": 1.3, "logit_bias": {13: -5.0}},
    {**GREEDY, "repetition_penalty": 1.2, "frequency_penalty": 0.4, "min_tokens": 8},
    {**SAMPLED},  # plain
    {**GREEDY, "repetition_penalty": 0.9, "presence_penalty": -0.5, "logit_bias": {11: 4.0}},
]
PLAIN = [1, 4]


def _random_reqs(n: int, gen: torch.Generator) -> list[Req]:
    """`n` requests in shuffled request-table rows, with prompts and outputs of random ids and
    settings from neutral to strong."""
    rows = torch.randperm(2 * n, generator=gen)[:n].tolist()
    reqs = []
    for i, row in enumerate(rows):
        ids = torch.randint(0, VOCAB, (40 + i,), generator=gen).tolist()
        params = SamplingParams(
            repetition_penalty=[1.3, 1.0, 0.8][i % 3],  # i = 1, 13, 25...: no penalty
            frequency_penalty=[0.5, 0.0, -1.0, 2.0][i % 4],
            presence_penalty=[-0.4, 0.0, 1.5][i % 3],
            logit_bias={int(ids[0]): 7.5} if i % 2 else {},
            min_tokens=30 if i % 5 == 0 else 0,
            stop_token_ids=[5],
        )
        req = Req(f"r{i}", ids[:20], params, i, 64, req_pool_idx=row)
        req.output_ids = ids[20:] + ids[20 : 20 + i % 7]  # repeats: counts above 1
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("bs", [1, 64])
def test_batch_adjustments_equal_the_reference(bs):
    gen = torch.Generator().manual_seed(bs)
    adjuster = LogitAdjuster(128, VOCAB, torch.device("cuda"))
    reqs = _random_reqs(bs, gen)
    eos = frozenset({2})
    adjuster.init_requests(reqs)
    for _ in range(3):  # then two steps counted on the device
        logits = torch.randn(bs, VOCAB, generator=gen) * 5
        step = adjuster.adjustments(reqs, [len(r.output_ids) for r in reqs], eos)
        assert step is not None and step.rows is not None
        got = step.apply(logits.cuda())
        with kernels.native_only():  # the torch code on the GPU: the kernel's twin
            assert torch.equal(step.apply(logits.cuda()), got)
        got = got.cpu()
        for i, req in enumerate(reqs):
            params = req.sampling_params
            want = reference_logits(logits[i], req.input_ids, req.output_ids, params, eos)
            assert torch.equal(got[i], want), (req.rid, (got[i] - want).abs().max())
        next_ids = torch.randint(0, VOCAB, (bs,), generator=gen)
        next_ids[0] = reqs[0].output_ids[0]  # a repeat
        step.record(next_ids.cuda())
        for req, token in zip(reqs, next_ids.tolist(), strict=True):
            req.output_ids.append(token)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=16384,
        max_running_requests=16,
        deterministic=True,
        cuda_graph_mode=json.dumps({"decode": "full", "prefill": "breakable"}),
    )


def _reqs(engine: Engine, indices: list[int]) -> list[Req]:
    return [
        Req(
            f"r{i}",
            engine.encode_chat([{"role": "user", "content": f"Write about {TOPICS[i]}."}]),
            SamplingParams(max_new_tokens=24 + 4 * i, **PARAMS[i]),
            1000 + i,
            24 + 4 * i,
        )
        for i in indices
    ]


def _scheduler(engine: Engine, overlap: bool) -> Scheduler:
    # a scheduler of its own over the engine's KV pool: no prefix cache to outlive it
    return Scheduler(
        engine.runner, engine.eos_token_ids, None, 2048, None, overlap=overlap, prefix_cache=False
    )


def _run(sched: Scheduler, reqs: list[Req]) -> None:
    for i, req in enumerate(reqs):
        sched.add(req)
        if i % 2:
            sched.step()  # the next ones join a running batch
    sched.run_to_completion()


def test_served_with_decode_graphs_every_row_equals_the_reference(engine, monkeypatch):
    graphs_before = engine.runner.forward_stats.phases["decode"].graph
    outputs = {}
    for overlap in (True, False):
        sched = _scheduler(engine, overlap)
        calls = record_sampling(sched, monkeypatch)
        reqs = _reqs(engine, list(range(len(PARAMS))))
        _run(sched, reqs)
        checked = check_against_reference(calls, reqs, engine.eos_token_ids)
        assert all(checked[r.rid] >= len(r.output_ids) > 0 for r in reqs)
        assert not set(reqs[3].output_ids[:8]) & engine.eos_token_ids  # its min_tokens
        outputs[overlap] = [r.output_ids for r in reqs]
    assert engine.runner.forward_stats.phases["decode"].graph > graphs_before
    assert outputs[True] == outputs[False]
    alone = _reqs(engine, PLAIN)
    _run(_scheduler(engine, True), alone)
    assert [r.output_ids for r in alone] == [outputs[True][i] for i in PLAIN]


def test_logit_bias_forces_a_token_under_graphs(engine):
    out = engine.generate(
        "Once upon a time",
        {"max_new_tokens": 8, "ignore_eos": True, "logit_bias": {28: 100}, **GREEDY},
    )
    assert out["output_ids"] == [28] * 8
