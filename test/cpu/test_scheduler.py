"""The continuous-batching scheduler on a tiny checkpoint (fast on the CPU).

Every check compares against the same request run alone (greedy), so batching, chunking,
retraction and late joining must not change any request's output.
"""

from __future__ import annotations

import pytest
from kv_accounting import assert_kv_released

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

GREEDY = {"ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def roomy(tiny_llama3) -> Engine:
    return Engine(model_path=tiny_llama3, device="cpu", max_total_tokens=2000)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(n)]


def _alone(engine: Engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    params = {"max_new_tokens": max_new, **GREEDY}
    return [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]


def test_a_tiny_kv_pool_keeps_outputs(tiny_llama3, roomy):
    """With no decode reserve (aggressive admission) the scheduler must retract requests
    mid-decode and recompute them; the default reserve retracts less. Outputs never change."""
    prompts = _prompts(5)
    expected = _alone(roomy, prompts, 40)
    retractions = {}
    for policy in ("aggressive", "default"):
        tiny = Engine(model_path=tiny_llama3, device="cpu", max_total_tokens=100)
        if policy == "aggressive":
            tiny.scheduler.new_token_ratio = tiny.scheduler.min_new_token_ratio = 0.0
        outs = tiny.generate(input_ids=prompts, sampling_params={"max_new_tokens": 40, **GREEDY})
        assert [o["output_ids"] for o in outs] == expected
        retractions[policy] = tiny.scheduler.num_retractions
        assert_kv_released(tiny)
    assert retractions["aggressive"] > retractions["default"], retractions


def test_chunked_prefill_equals_unchunked(tiny_llama3, roomy):
    prompts = _prompts(4)
    expected = _alone(roomy, prompts, 8)
    chunked = Engine(
        model_path=tiny_llama3,
        device="cpu",
        max_total_tokens=2000,
        chunked_prefill_size=4,
        max_prefill_tokens=6,
    )
    outs = chunked.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, **GREEDY})
    assert [o["output_ids"] for o in outs] == expected
    assert_kv_released(chunked)


def test_requests_joining_between_steps_and_abort(roomy):
    prompts = _prompts(3)
    expected = _alone(roomy, prompts, 12)
    sched = roomy.scheduler
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=12, **GREEDY), 0, 12)
        for i, p in enumerate(prompts)
    ]
    victim = Req("victim", prompts[0], SamplingParams(max_new_tokens=12, **GREEDY), 0, 12)
    sched.add(reqs[0])
    sched.add(victim)
    for _ in range(4):
        sched.step()
    sched.add(reqs[1])  # joins a running decode batch
    sched.step()
    used_before, victim_cached = sched.stats().kv_used_tokens, victim.kv_len
    assert victim_cached == len(victim.all_ids) - 1  # the newest token is not cached yet
    assert victim.shared_len == len(prompts[0])  # r0's prompt: one copy, in the prefix cache
    assert sched.abort("victim") is victim
    assert victim.finish_reason.type == "abort"
    # its own tokens become evictable; the prompt stays held by r0
    assert sched.stats().kv_used_tokens == used_before - (victim_cached - len(prompts[0]))
    sched.add(reqs[2])
    sched.run_to_completion()
    assert [r.output_ids for r in reqs] == expected
    assert_kv_released(roomy)


def test_output_budget_is_clamped_to_the_cache(tiny_llama3):
    small = Engine(model_path=tiny_llama3, device="cpu", max_total_tokens=100)
    out = small.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 500, **GREEDY})
    assert out["meta_info"]["completion_tokens"] == 90
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(ValueError, match="KV cache size"):
        small.generate(input_ids=[5] * 100)


def test_id_slice_is_the_slice_of_all_ids():
    req = Req("r", [10, 11, 12, 13], SamplingParams(), 0, 8)
    req.output_ids = [20, 21, 22]
    for start in range(8):
        for end in range(start, 9):
            assert req.id_slice(start, end) == req.all_ids[start:end], (start, end)
