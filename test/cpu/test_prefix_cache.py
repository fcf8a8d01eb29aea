"""The prefix cache through the scheduler (tiny checkpoint, CPU, greedy): outputs equal the cache
off, under eviction pressure, chunked prefill, retraction and aborts; cached tokens are
reported; the KV pool is whole again at the end of every scenario."""

from __future__ import annotations

import random

import pytest
from kv_accounting import assert_kv_released

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

GREEDY = {"ignore_eos": True, "temperature": 0.0}


def _engine(tiny_llama3: str, cache: bool = True, **kwargs) -> Engine:
    args = {"max_total_tokens": 4000, "disable_radix_cache": not cache, **kwargs}
    return Engine(model_path=tiny_llama3, device="cpu", **args)


def _shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts drawn from three shared prefixes (a system prompt, a few-shot block, ...) plus
    their own tails of varied length; some repeat whole."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(length)] for length in (40, 25, 60)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]
        prompts.append(prefixes[i % 3] + tail if i % 7 else prefixes[i % 3])
    return prompts


def _generate(engine: Engine, prompts: list[list[int]], max_new: int) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new, **GREEDY})


def test_a_repeated_prompt_reuses_its_prefix(tiny_llama3):
    engine = _engine(tiny_llama3)
    prompt = _shared_prefix_prompts(1)[0]
    first = _generate(engine, [prompt], 6)[0]
    assert first["meta_info"]["cached_tokens"] == 0
    again = _generate(engine, [prompt + [7, 8]], 6)[0]
    # the first request's prompt and output are cached; the new prompt's last token is computed
    assert again["meta_info"]["cached_tokens"] == len(prompt)
    stats = engine.scheduler.stats()
    assert stats.prefix_cached_tokens == len(prompt)
    assert stats.prefix_prompt_tokens == 2 * len(prompt) + 2
    assert_kv_released(engine)


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"chunked_prefill_size": 16, "max_prefill_tokens": 24},  # chunks inserted as they finish
        {"max_total_tokens": 160},  # eviction, and retraction of running requests
    ],
    ids=["roomy", "chunked", "tiny_pool"],
)
def test_outputs_equal_the_cache_off(tiny_llama3, setting):
    prompts = _shared_prefix_prompts(24)
    expected = [o["output_ids"] for o in _generate(_engine(tiny_llama3, cache=False), prompts, 12)]
    engine = _engine(tiny_llama3, **setting)
    for round_ in range(2):  # the second round finds the first's prompts cached
        outs = _generate(engine, prompts, 12)
        assert [o["output_ids"] for o in outs] == expected, round_
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        assert cached > 0
    if "max_total_tokens" in setting:
        assert engine.scheduler.num_retractions > 0
    assert_kv_released(engine)


def test_mixed_requests_with_aborts_on_a_tiny_pool(tiny_llama3):
    """150 requests with shared prefixes arriving over time on a pool that forces eviction and
    retraction, a quarter aborted mid-flight: every other output equals its solo run, and
    nothing leaks."""
    prompts = _shared_prefix_prompts(150, seed=1)
    rng = random.Random(2)
    max_new = [rng.randrange(1, 16) for _ in prompts]
    solo_engine = _engine(tiny_llama3, cache=False)
    solo = [
        solo_engine.generate(input_ids=p, sampling_params={"max_new_tokens": m, **GREEDY})[
            "output_ids"
        ]
        for p, m in zip(prompts, max_new, strict=True)
    ]
    engine = _engine(
        tiny_llama3, max_total_tokens=220, chunked_prefill_size=32, max_prefill_tokens=64
    )
    sched = engine.scheduler
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=m, **GREEDY), 0, m)
        for i, (p, m) in enumerate(zip(prompts, max_new, strict=True))
    ]
    doomed = set(rng.sample(range(len(reqs)), len(reqs) // 4))
    arrivals, added = list(range(len(reqs))), set()
    step = 0
    while arrivals or sched.has_work:
        for _ in range(min(rng.randrange(0, 6), len(arrivals))):  # a few arrive each step
            i = arrivals.pop(0)
            sched.add(reqs[i])
            added.add(i)
        for i in sorted(doomed & added):
            if rng.random() < 0.3:  # somewhere between waiting and its last token
                doomed.discard(i)
                sched.abort(reqs[i].rid)
        sched.step()
        step += 1
        assert step < 20_000
    aborted = {i for i, r in enumerate(reqs) if r.finish_reason.type == "abort"}
    assert len(aborted) >= len(reqs) // 8
    for i, req in enumerate(reqs):
        if i not in aborted:
            assert req.output_ids == solo[i], req.rid
    assert sum(r.cached_tokens for r in reqs) > 0
    assert sched.num_retractions > 0
    assert_kv_released(engine)


def test_flush_frees_only_what_no_request_holds(tiny_llama3):
    engine = _engine(tiny_llama3)
    prompts = _shared_prefix_prompts(3)
    _generate(engine, prompts, 4)
    sched = engine.scheduler
    tree = sched.prefix_cache.tree
    assert tree is not None and tree.total_size > 0
    holder = Req("holder", prompts[0] + [5], SamplingParams(max_new_tokens=8, **GREEDY), 0, 8)
    sched.add(holder)
    sched.step()  # its prefill: the prefix it found is locked
    assert holder.shared_len > 0
    freed = sched.prefix_cache.flush()
    assert freed > 0 and tree.total_size == tree.protected_size > 0
    sched.run_to_completion()
    assert_kv_released(engine)


def test_prompt_logprobs_requests_compute_every_position(tiny_llama3):
    engine = _engine(tiny_llama3)
    prompt = _shared_prefix_prompts(1)[0]
    _generate(engine, [prompt], 2)
    req = Req("lp", prompt, SamplingParams(max_new_tokens=2, **GREEDY), 0, 2, prompt_logprobs=0)
    engine.scheduler.add(req)
    engine.scheduler.run_to_completion()
    assert req.cached_tokens == 0 and req.prompt_logprobs_done == len(prompt) - 1
    assert_kv_released(engine)
