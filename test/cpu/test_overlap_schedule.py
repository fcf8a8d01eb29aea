"""The overlap schedule (each decode step launched before the one before it is read back) on a
tiny checkpoint: every request's tokens, finish reasons and logprobs equal those of the schedule
that reads each step back first, with requests joining, finishing by length, stop token and stop
string mid-flight, sampled with seeds, aborted, and retracted under a small KV cache."""

from __future__ import annotations

import pytest
from kv_accounting import assert_kv_released

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.io_struct import TokenLogprob
from replaylm.runtime.request import FinishReason, Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams

from tiny_checkpoints import write_tiny_checkpoint

PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(8)]
ARRIVAL_STEP = [0, 0, 0, 2, 3, 3, 6, 9]  # the step before which each request is added


def _text(ids: list[int]) -> str:
    """A detokenizer for the tiny vocabulary: ' <id>' per token (stop strings match on it)."""
    return "".join(f" <{i}>" for i in ids)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    folder = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_checkpoint("llama3", folder)
    return Engine(model_path=str(folder), device="cpu", max_total_tokens=2000)


def _scheduler(engine: Engine, overlap: bool) -> Scheduler:
    """A fresh scheduler over the engine's KV pool, in place of the engine's (whose prefix cache
    gives its slots back first)."""
    engine.flush_cache()
    engine.scheduler = Scheduler(
        engine.runner,
        frozenset(),
        _text,
        chunked_prefill_size=16,
        max_prefill_tokens=None,
        overlap=overlap,
    )
    return engine.scheduler


def _params(i: int, stops: dict[str, object]) -> SamplingParams:
    sampled = {"temperature": 0.8, "top_p": 0.9} if i % 2 else {"temperature": 0.0}
    return SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True, **sampled, **stops)


def _run(
    engine: Engine,
    overlap: bool,
    stops: list[dict[str, object]],
    abort: tuple[int, int] | None = None,
) -> tuple[list[Req], list[list[TokenLogprob]]]:
    """Run PROMPTS through a fresh scheduler (request i joining before step ARRIVAL_STEP[i],
    request `abort[0]` aborted before step `abort[1]`); the requests and their logprobs."""
    sched = _scheduler(engine, overlap)
    reqs = [
        Req(f"r{i}", p, _params(i, stops[i]), 1000 + i, 6 + 3 * i, top_logprobs=2)
        for i, p in enumerate(PROMPTS)
    ]
    logprobs: dict[str, list[TokenLogprob]] = {r.rid: [] for r in reqs}
    step = 0
    while step <= max(ARRIVAL_STEP) or sched.has_work:
        for i, at in enumerate(ARRIVAL_STEP):
            if at == step:
                sched.add(reqs[i])
        if abort is not None and abort[1] == step:
            assert sched.abort(reqs[abort[0]].rid) is reqs[abort[0]]
        for out in sched.step():
            assert out.logprobs is not None and len(out.new_token_ids) == 1
            logprobs[out.req.rid] += out.logprobs
        step += 1
    return reqs, [logprobs[r.rid] for r in reqs]


def _assert_same_logprobs(got: list[TokenLogprob], want: list[TokenLogprob]) -> None:
    assert [g.token_id for g in got] == [w.token_id for w in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)


def test_overlap_equals_reading_each_step_back(engine):
    # stops found from a first run: request 2 stops on a token id, request 5 on a string, each
    # at its 4th token (a finish the scheduler learns only when it reads that step back)
    free_run, _ = _run(engine, False, [{}] * len(PROMPTS))
    stops: list[dict[str, object]] = [{} for _ in PROMPTS]
    stops[2] = {"stop_token_ids": [free_run[2].output_ids[3]]}
    stops[5] = {"stop": [f" <{free_run[5].output_ids[3]}>"]}
    sync, sync_lp = _run(engine, False, stops)
    assert_kv_released(engine)
    overlap, overlap_lp = _run(engine, True, stops)
    assert_kv_released(engine)
    for a, b, la, lb in zip(overlap, sync, overlap_lp, sync_lp, strict=True):
        assert a.output_ids == b.output_ids, a.rid
        assert a.finish_reason == b.finish_reason, a.rid
        _assert_same_logprobs(la, lb)
    assert [r.finish_reason.type for r in overlap[2:6:3]] == ["stop", "stop"]
    assert len(overlap[2].output_ids) <= 4 and len(overlap[5].output_ids) <= 4
    assert all(
        r.finish_reason == FinishReason("length") for i, r in enumerate(overlap) if i not in (2, 5)
    )


def test_an_abort_mid_flight_loses_nothing_else(engine):
    sync, _ = _run(engine, False, [{}] * len(PROMPTS))
    overlap, _ = _run(engine, True, [{}] * len(PROMPTS), abort=(4, 7))
    assert_kv_released(engine)
    victim = overlap[4]
    assert victim.finish_reason.type == "abort"
    assert sync[4].output_ids[: len(victim.output_ids)] == victim.output_ids
    assert len(victim.output_ids) < len(sync[4].output_ids)
    for i, (a, b) in enumerate(zip(overlap, sync, strict=True)):
        if i != 4:
            assert a.output_ids == b.output_ids, a.rid


def test_a_step_returns_the_tokens_of_the_step_before(engine):
    """Overlap: the prefill step returns nothing (its first token is in flight), each decode
    step the step before's; the last step reads the final one back. Without: each its own."""
    for overlap in (False, True):
        sched = _scheduler(engine, overlap)
        req = Req("one", PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.0), 0, 4)
        sched.add(req)
        counts = []
        while sched.has_work:
            counts.append(len(sched.step()))
        assert req.finish_reason == FinishReason("length") and len(req.output_ids) == 4
        # prefill, then 3 decode steps (the last token's step is left out: its end is known)
        assert counts == ([0, 1, 1, 1, 1] if overlap else [1, 1, 1, 1]), counts
    assert_kv_released(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_under_a_tiny_kv_cache(engine, overlap):
    folder = engine.server_args.model_path
    params = {"max_new_tokens": 30, "ignore_eos": True, "temperature": 0.0}
    expected = [
        engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS[:5]
    ]
    tiny = Engine(
        model_path=folder, device="cpu", max_total_tokens=90, disable_overlap_schedule=not overlap
    )
    tiny.scheduler.new_token_ratio = tiny.scheduler.min_new_token_ratio = 0.0
    outs = tiny.generate(input_ids=PROMPTS[:5], sampling_params=params)
    assert [o["output_ids"] for o in outs] == expected
    assert tiny.scheduler.num_retractions > 0
    assert_kv_released(tiny)
