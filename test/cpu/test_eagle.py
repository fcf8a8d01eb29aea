"""EAGLE and EAGLE-3 heads as drafters, on a tiny Llama target and random heads of the published
layout written by the test.

The drafts are checked against a reference written here from the heads' published
architecture, fed the target's hidden states as transformers computes them: after the prefill
(the head catches up on the whole prompt) and again after verify steps (it catches up on the
accepted tokens). Under continuous batching (waves of requests, an abort, a tiny KV pool that
retracts, the prefix cache off) the output equals plain decoding's and every KV slot of both
models goes back. Heads that cannot serve the target are refused at start in one line.
"""

from __future__ import annotations

import pytest
from eagle_reference import LAYER_IDS, reference_drafts
from test_speculative import PROMPTS, _assert_all_released, _run

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from tiny_checkpoints import write_tiny_checkpoint, write_tiny_eagle_head

STEPS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle_target")
    return str(path), write_tiny_checkpoint("llama3_deep", path)


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def head(request, target, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(f"{kind}_head")
    tensors = write_tiny_eagle_head(kind, path, target[1].config, layer_ids=LAYER_IDS)
    return kind, str(path), tensors


def _engine(target_path: str, head: tuple, **kwargs) -> Engine:
    kind, path, _ = head
    return Engine(
        model_path=target_path,
        device="cpu",
        speculative_algorithm=kind,
        speculative_draft_model_path=path,
        speculative_num_steps=STEPS,
        **{"max_total_tokens": 2000, **kwargs},
    )


# ---- the drafts -----------------------------------------------------------------------------


def test_drafts_equal_the_reference_after_prefill_and_after_verify_steps(target, head):
    kind, _, tensors = head
    engine = _engine(target[0], head)
    sched = engine.scheduler
    drafter = sched.speculation.drafter
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [Req(f"r{i}", PROMPTS[i], params, i, 40) for i in (2, 5)]
    for req in reqs:
        sched.add(req)
    sched.step()  # both prompts prefilled, one token each
    for _ in range(4):  # each check proposes as the next verify step will
        for req in reqs:
            ids = req.id_slice(0, req.num_ids)
            expected = reference_drafts(kind, tensors, target[1], ids, STEPS)
            assert drafter.propose([req], [STEPS]) == [expected], (req.rid, len(req.output_ids))
        drafter.accepted(reqs, [0, 0])
        sched.step()  # a verify step: the head catches up on what it accepted next time
    assert all(len(r.output_ids) > 4 for r in reqs)
    for req in reqs:
        sched.abort(req.rid)
    sched.run_to_completion()
    _assert_all_released(engine)


def test_one_proposal_over_several_catch_up_chunks_equals_the_reference(target, head):
    kind, _, tensors = head
    engine = _engine(target[0], head, chunked_prefill_size=16)
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [Req(f"r{i}", PROMPTS[i], params, i, 8) for i in (7, 1, 6)]  # 50, 14, 44 tokens
    for req in reqs:
        sched.add(req)
    while not all(r.output_ids for r in reqs):
        sched.step()
    drafts = sched.speculation.drafter.propose(reqs, [STEPS, 2, STEPS])
    for req, got, steps in zip(reqs, drafts, [STEPS, 2, STEPS], strict=True):
        ids = req.id_slice(0, req.num_ids)
        assert got == reference_drafts(kind, tensors, target[1], ids, steps), req.rid


# ---- continuous batching --------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(target) -> list[Req]:
    return _run(Engine(model_path=target[0], device="cpu", max_total_tokens=2000), abort=4)


@pytest.mark.parametrize(
    "flags",
    [{}, {"disable_radix_cache": True}, {"max_total_tokens": 160, "max_running_requests": 8}],
    ids=["default", "no-prefix-cache", "tiny-kv"],
)
def test_batches_equal_plain_decoding_and_give_every_slot_back(target, head, plain_run, flags):
    engine = _engine(target[0], head, **flags)
    reqs = _run(engine, abort=4)
    for i, (req, plain) in enumerate(zip(reqs, plain_run, strict=True)):
        assert req.finish_reason == plain.finish_reason, i
        if i != 4:
            assert req.output_ids == plain.output_ids, i
    assert engine.scheduler.speculation.stats.drafted > 50
    if "max_total_tokens" in flags:
        assert engine.scheduler.num_retractions > 0
    _assert_all_released(engine)


# ---- refused at start -----------------------------------------------------------------------


def test_heads_that_cannot_serve_the_target_are_refused(target, head, tmp_path, tiny_llama3):
    kind, path, _ = head
    other = "eagle3" if kind == "eagle" else "eagle"
    with pytest.raises(ValueError, match=f"takes a {'LlamaForCausalLMEagle'}"):
        _engine(target[0], (other, path, None))
    with pytest.raises(ValueError, match="is an EAGLE head .* use --speculative-algorithm"):
        Engine(
            model_path=target[0],
            device="cpu",
            max_total_tokens=2000,
            speculative_algorithm="draft_model",
            speculative_draft_model_path=path,
        )
    with pytest.raises(ValueError, match="is an EAGLE draft head"):
        Engine(model_path=path, device="cpu", max_total_tokens=2000)
    if kind == "eagle3":  # tiny_llama3 has two layers: no layer 3 to read
        with pytest.raises(ValueError, match=r"reads the inputs of target layers \[1, 2, 3\]"):
            _engine(tiny_llama3, head)
    with pytest.raises(ValueError, match="runs at --tp-size 1"):
        _engine(target[0], head, tp_size=2)
