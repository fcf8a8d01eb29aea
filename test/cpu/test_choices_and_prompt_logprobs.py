"""`n > 1` choices forked from one prefill, and prompt logprobs, on a tiny checkpoint whose HF
model is the reference."""

from __future__ import annotations

import logging

import pytest
import torch
from kv_accounting import assert_kv_released

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from tiny_checkpoints import write_tiny_checkpoint

PROMPT = [(11 * j) % 300 + 3 for j in range(13)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return str(path), write_tiny_checkpoint("llama3", path)


def _engine(folder: str, **kwargs) -> Engine:
    return Engine(model_path=folder, device="cpu", **{"max_total_tokens": 2000, **kwargs})


def _req(rid: str, seed: int, max_new: int = 6, **kwargs) -> Req:
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    return Req(rid, list(PROMPT), params, seed, max_new, **kwargs)


def _run(engine: Engine, *reqs: Req) -> None:
    for req in reqs:
        engine.scheduler.add(req)
    engine.scheduler.run_to_completion()
    assert_kv_released(engine)


def _prompt_logprobs(engine: Engine, k: int) -> list:
    outputs = []
    req = _req("a", 1, prompt_logprobs=k)
    engine.scheduler.add(req)
    while not req.finished:
        outputs += [o for o in engine.scheduler.step() if o.prompt_logprobs is not None]
    engine.scheduler.run_to_completion()
    assert len(outputs) == 1  # with the first token, once
    return outputs[0].prompt_logprobs


@pytest.mark.parametrize("chunk", [None, 4])
def test_prompt_logprobs_equal_the_reference_model(checkpoint, chunk):
    """Every prompt token's logprob and top 5, from one prefill or from chunks of 4 tokens."""
    folder, hf = checkpoint
    kwargs = {"chunked_prefill_size": chunk, "max_prefill_tokens": chunk} if chunk else {}
    got = _prompt_logprobs(_engine(folder, **kwargs), k=5)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    assert len(got) == len(PROMPT) and got[0] is None
    for j, entry in enumerate(got[1:], start=1):
        assert entry.token_id == PROMPT[j]
        assert entry.logprob == pytest.approx(ref[j - 1, PROMPT[j]].item(), abs=1e-4)
        vals, ids = ref[j - 1].topk(5)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(vals.tolist(), abs=1e-4)


def test_prompt_logprobs_are_sent_once_after_a_retraction(checkpoint):
    """A request retracted mid-decode recomputes its prompt, not its prompt logprobs."""
    folder, _ = checkpoint
    engine = _engine(folder, max_total_tokens=60)
    engine.scheduler.new_token_ratio = engine.scheduler.min_new_token_ratio = 0.0
    reqs = [_req(str(i), i, max_new=20, prompt_logprobs=0) for i in range(4)]
    sent: dict[str, int] = {}
    for req in reqs:
        engine.scheduler.add(req)
    while engine.scheduler.has_work:
        for out in engine.scheduler.step():
            if out.prompt_logprobs is not None:
                assert len(out.prompt_logprobs) == len(PROMPT)
                sent[out.req.rid] = sent.get(out.req.rid, 0) + 1
    assert engine.scheduler.num_retractions > 0
    assert sent == {str(i): 1 for i in range(4)}
    assert all(len(r.prompt_logprob_chunks[-1].chosen) for r in reqs)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["shared", "copied"])
def test_forked_choices_equal_requests_of_their_own(checkpoint, prefix_cache):
    """Choices forked from the parent's prefill (its cached prompt shared through the prefix
    cache, or a copy of its KV without it) sample exactly as requests with the same seeds run
    alone; the prefill runs once."""
    folder, _ = checkpoint
    alone = []
    for seed in (5, 6, 7):
        req = _req(f"alone{seed}", seed)
        _run(_engine(folder), req)
        alone.append(req.output_ids)
    assert len({tuple(o) for o in alone}) > 1  # the seeds matter

    engine = _engine(folder, disable_radix_cache=not prefix_cache)
    parent = _req("p", 5, forks=[("p-1", 6), ("p-2", 7)])
    engine.scheduler.add(parent)
    engine.scheduler.step()  # the prefill, then the forks' first tokens (in flight)
    assert {r.rid for r in engine.scheduler.running} == {"p", "p-1", "p-2"}
    children = [r for r in engine.scheduler.running if r is not parent]
    prompt_copies = 1 if prefix_cache else 3
    assert engine.scheduler.stats().kv_used_tokens == prompt_copies * len(PROMPT)
    if prefix_cache:
        assert all(c.kv_slots == parent.kv_slots for c in children)
    engine.scheduler.run_to_completion()
    assert [parent.output_ids, *(c.output_ids for c in children)] == alone
    prefills = engine.runner.forward_stats.phases["prefill"]
    assert prefills.eager + prefills.graph == 1
    assert_kv_released(engine)


def test_choices_without_room_to_fork_prefill_alone(checkpoint, caplog):
    """With too little KV for the copies, the other choices prefill on their own, later: each
    still gets the tokens of its seed."""
    folder, _ = checkpoint
    expected = []
    for seed in (5, 6):
        req = _req(f"alone{seed}", seed)
        _run(_engine(folder), req)
        expected.append(req.output_ids)
    caplog.set_level(logging.INFO, logger="replaylm.runtime.scheduler")
    engine = _engine(folder, max_total_tokens=24, disable_radix_cache=True)
    parent = _req("p", 5, forks=[("p-1", 6)])
    engine.scheduler.add(parent)
    engine.scheduler.step()  # the prefill; its first token in flight
    assert [r.rid for r in engine.scheduler.running] == ["p"]  # no room for a copy of its KV
    assert "prefill alone" in caplog.text
    child = next(r for r in engine.scheduler.waiting if r.rid == "p-1")
    engine.scheduler.run_to_completion()
    assert [parent.output_ids, child.output_ids] == expected
    # the prefix cache shares the prompt instead: both choices fit the same pool at once
    engine = _engine(folder, max_total_tokens=24)
    parent = _req("p", 5, forks=[("p-1", 6)])
    engine.scheduler.add(parent)
    engine.scheduler.step()
    assert [r.rid for r in engine.scheduler.running] == ["p", "p-1"]
    child = engine.scheduler.running[1]
    engine.scheduler.run_to_completion()
    assert [parent.output_ids, child.output_ids] == expected
    assert_kv_released(engine)


def test_aborting_a_pending_choice_keeps_the_others(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder)
    parent = _req("p", 5, forks=[("p-1", 6), ("p-2", 7)])
    engine.scheduler.add(parent)
    aborted = engine.scheduler.abort("p-1")
    assert aborted is not None and aborted.finish_reason.type == "abort"
    finished = {o.req.rid for o in engine.scheduler.step()}
    while engine.scheduler.has_work:
        finished |= {o.req.rid for o in engine.scheduler.step()}
    assert finished == {"p", "p-2"}
