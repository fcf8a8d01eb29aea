"""Penalties, logit_bias, min_tokens, allowed and banned ids on a tiny checkpoint through the
real scheduler.

Every sampled row's logits are compared with a plain torch reference computed from the
request's prompt and the tokens it had out at that step (test/penalty_reference.py), with
requests joining mid-run, the overlap schedule on and off, and retraction under a small KV
cache; plus each feature's visible effect and the untouched fast path.
"""

from __future__ import annotations

import pytest
import torch

from replaylm.entrypoints.engine import Engine
from replaylm.layers.logit_adjust import LogitAdjuster
from replaylm.runtime.errors import RequestError
from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams

from penalty_reference import check_against_reference, record_sampling

EOS = 2  # the tiny checkpoints' eos_token_id
PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(7)]
ARRIVAL_STEP = [0, 0, 1, 2, 4, 4, 7]
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
PARAMS = [
    {**GREEDY, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    {**GREEDY},  # plain
    {**SAMPLED, "repetition_penalty": 1.8},
    {**GREEDY, "repetition_penalty": 0.6, "frequency_penalty": -1.0},
    {**SAMPLED},  # plain
    {**GREEDY, "presence_penalty": -0.5, "logit_bias": {7: 3.0, EOS: 100}, "min_tokens": 6},
    {**SAMPLED, "min_tokens": 5, "stop_token_ids": [9], "logit_bias": {9: 2.0, 11: -2.0}},
]


@pytest.fixture(scope="module")
def engine(tiny_llama3) -> Engine:
    return Engine(model_path=tiny_llama3, device="cpu", max_total_tokens=2000)


def _reqs(max_new: int = 14) -> list[Req]:
    return [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=max_new, **PARAMS[i]), 1000 + i, max_new)
        for i, p in enumerate(PROMPTS)
    ]


def _run(sched: Scheduler, reqs: list[Req]) -> None:
    """Request i joins before step ARRIVAL_STEP[i]; step until all have finished."""
    step = 0
    while step <= max(ARRIVAL_STEP) or sched.has_work:
        for req, at in zip(reqs, ARRIVAL_STEP, strict=True):
            if at == step:
                sched.add(req)
        sched.step()
        step += 1


def _scheduler(engine: Engine, overlap: bool) -> Scheduler:
    # a scheduler of its own over the engine's KV pool: no prefix cache to outlive it
    return Scheduler(
        engine.runner, frozenset({EOS}), None, 16, None, overlap=overlap, prefix_cache=False
    )


@pytest.fixture(scope="module")
def runs(engine) -> dict[bool, list[Req]]:
    """The requests run with the overlap schedule (True) and without, each checked row by row
    against the reference while it ran."""
    done = {}
    for overlap in (True, False):
        sched, reqs = _scheduler(engine, overlap), _reqs()
        with pytest.MonkeyPatch.context() as mp:
            calls = record_sampling(sched, mp)
            _run(sched, reqs)
        checked = check_against_reference(calls, reqs, {EOS})
        assert all(checked[r.rid] >= len(r.output_ids) for r in reqs)
        done[overlap] = reqs
    return done


def test_every_sampled_row_equals_the_reference(runs):
    for reqs in runs.values():
        assert all(r.finished and r.output_ids for r in reqs)


def test_overlap_on_and_off_give_the_same_tokens(runs):
    for on, off in zip(runs[True], runs[False], strict=True):
        assert on.output_ids == off.output_ids, on.rid
        assert on.finish_reason == off.finish_reason, on.rid


def test_min_tokens_holds_eos_and_stop_ids_back(runs):
    for reqs in runs.values():
        five, six = reqs[5], reqs[6]
        # EOS biased up by 100: held back for 6 tokens, then it comes at once
        assert EOS not in five.output_ids[:6] and five.output_ids[6:] == [EOS]
        assert five.finish_reason.type == "stop"
        assert 9 not in six.output_ids[:5]


def test_plain_requests_sample_as_without_penalised_companions(engine, runs):
    plain = [1, 4]  # greedy and sampled, no penalty, bias or min_tokens
    reqs = _reqs()
    sched = _scheduler(engine, True)
    for i in plain:
        sched.add(reqs[i])
    sched.run_to_completion()
    assert [reqs[i].output_ids for i in plain] == [runs[True][i].output_ids for i in plain]


def test_state_is_rebuilt_after_retraction(tiny_llama3, engine, monkeypatch):
    roomy = _reqs(30)
    _run(_scheduler(engine, True), roomy)
    tiny = Engine(model_path=tiny_llama3, device="cpu", max_total_tokens=100)
    sched = _scheduler(tiny, True)
    sched.new_token_ratio = sched.min_new_token_ratio = 0.0  # admit eagerly, retract later
    calls = record_sampling(sched, monkeypatch)
    reqs = _reqs(30)
    _run(sched, reqs)
    assert sched.num_retractions > 0
    check_against_reference(calls, reqs, {EOS})
    assert [r.output_ids for r in reqs] == [r.output_ids for r in roomy]


def test_logit_bias_forces_and_forbids_greedy_tokens(engine):
    prompt = PROMPTS[3]
    base = {"max_new_tokens": 10, "ignore_eos": True, **GREEDY}
    free = engine.generate(input_ids=prompt, sampling_params=base)["output_ids"]
    forced = engine.generate(input_ids=prompt, sampling_params={**base, "logit_bias": {17: 100}})
    assert forced["output_ids"] == [17] * 10
    banned = {t: -100 for t in set(free)}
    other = engine.generate(input_ids=prompt, sampling_params={**base, "logit_bias": banned})
    assert not set(other["output_ids"]) & set(free)


def test_allowed_and_banned_ids_beside_penalised_and_plain_rows(engine):
    """One batch: banned ids are never sampled, greedy takes the best allowed id (with its
    logit_bias: the allowed ids keep their adjusted logits), and the other rows sample as
    alone."""
    prompt = PROMPTS[3]
    base = {"max_new_tokens": 10, "ignore_eos": True, **GREEDY}
    free = engine.generate(input_ids=prompt, sampling_params=base)["output_ids"]
    penalised = {**base, "presence_penalty": 1.5}
    alone = engine.generate(input_ids=prompt, sampling_params=penalised)["output_ids"]
    params = [
        {**base, "banned_token_ids": sorted(set(free))},
        {**base, "allowed_token_ids": [free[0], 40, 41]},
        {**base, "allowed_token_ids": [17, 40], "logit_bias": {40: 100}},
        penalised,
        base,
    ]
    outs = [
        o["output_ids"] for o in engine.generate(input_ids=[prompt] * 5, sampling_params=params)
    ]
    assert outs[0] and not set(outs[0]) & set(free)
    assert outs[1][0] == free[0] and set(outs[1]) <= {free[0], 40, 41}
    assert outs[2] == [40] * 10
    assert outs[3:] == [alone, free]


def test_min_tokens_wins_over_a_forced_eos(engine):
    prompt = PROMPTS[2]
    params = {"max_new_tokens": 12, "logit_bias": {EOS: 100}, **GREEDY}
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == [EOS]
    out = engine.generate(input_ids=prompt, sampling_params={**params, "min_tokens": 4})
    assert len(out["output_ids"]) == 5 and out["output_ids"][4] == EOS
    assert EOS not in out["output_ids"][:4]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # ignore_eos keeps generating, but min_tokens still holds EOS back first
    kept = {**params, "min_tokens": 4, "ignore_eos": True}
    ids = engine.generate(input_ids=prompt, sampling_params=kept)["output_ids"]
    assert EOS not in ids[:4] and ids[4:] == [EOS] * 8


def test_a_batch_without_adjustments_builds_nothing():
    adjuster = LogitAdjuster(4, 50, torch.device("cpu"))
    plain = Req("a", [3, 4], SamplingParams(min_tokens=2), 0, 8, req_pool_idx=1)
    assert adjuster.adjustments([plain], [0], frozenset()) is None  # no EOS, no stop ids
    assert adjuster.adjustments([plain], [2], frozenset({EOS})) is None  # min_tokens reached
    adjuster.init_requests([plain])
    assert adjuster.memory_bytes == 0  # nothing allocated without a penalised request
    biased = Req("b", [3], SamplingParams(logit_bias={5: 1.0}), 0, 8, req_pool_idx=2)
    step = adjuster.adjustments([plain, biased], [0, 0], frozenset())
    assert step is not None and step.rows is None and adjuster.memory_bytes == 0
    logits = torch.zeros(2, 50)
    assert torch.equal(step.apply(logits)[1].nonzero().flatten(), torch.tensor([5]))
    assert not logits.any()  # the model's logits are left alone
    penalised = Req("c", [3, 3, 7], SamplingParams(presence_penalty=1.0), 0, 8, req_pool_idx=3)
    penalised.output_ids = [7, 8, 8]
    adjuster.init_requests([plain, penalised])
    assert adjuster.memory_bytes == 4 * 50 * 5
    counts, prompt_mask = adjuster.state()
    assert counts[3].nonzero().flatten().tolist() == [7, 8] and counts[3, 8] == 2
    assert prompt_mask[3].nonzero().flatten().tolist() == [3, 7]


def test_out_of_vocabulary_ids_are_refused(engine):
    for field, value in (
        ("logit_bias", {320: 1.0}),
        ("stop_token_ids", [5, 400]),
        ("allowed_token_ids", [5, 400]),
        ("banned_token_ids", [400]),
    ):
        with pytest.raises(RequestError, match="outside the vocabulary") as err:
            engine.generate(input_ids=[5, 6], sampling_params={field: value})
        assert err.value.param == field
