"""Speculative decoding with the n-gram drafter (`--speculative-algorithm ngram`): greedy output
equals plain decoding on the real SmolLM2 (asked to repeat a passage: most drafts accepted) and
on a tiny checkpoint under continuous batching (requests joining, sampled and logprob requests
beside speculating ones, stops and token budgets inside an accepted run, an abort, retraction
under a tiny KV pool, the prefix cache on and off), every KV slot given back; the drafter, the
acceptance rule and the flags' checks alone."""

from __future__ import annotations

import json

import httpx
import pytest
from kv_accounting import assert_kv_released

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs
from replaylm.speculative.drafter import accept_matching
from replaylm.speculative.ngram import NgramDrafter
from replaylm.speculative.stats import SpeculationStats

from http_helpers import HTTP_SERVER_FLAGS, TIMEOUT_S

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. To be or not to be, that is the question. All that glitters is not gold."
)
GREEDY = {"temperature": 0.0}
MAX_NEW = 24
# repetitive prompts, so that the n-gram drafter finds matches on the tiny model too
PROMPTS = [[(5 * i + j % (3 + i)) % 200 + 3 for j in range(8 + 6 * i)] for i in range(8)]


def _req(ids: list[int], **params) -> Req:
    sp = SamplingParams(**{"max_new_tokens": MAX_NEW, **params})
    return Req("r", ids, sp, 0, sp.max_new_tokens)


# ---- the drafter and the acceptance rule alone ----------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(min_window=2, max_window=3)
    req = _req([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3])
    # [2, 3] last ended at index 8 (followed by 5, 6, 7), later than the [2, 3] at index 3
    assert drafter.propose([req], [3]) == [[5, 6, 7]]
    assert drafter.propose([req], [2]) == [[5, 6]]
    assert drafter.propose([req], [0]) == [[]]
    req.output_ids += [4]  # [2, 3, 4] matches the first occurrence: the longer window wins
    assert drafter.propose([req], [4]) == [[9, 1, 2, 3]]


def test_ngram_without_a_match_proposes_nothing():
    drafter = NgramDrafter(min_window=2, max_window=4)
    assert drafter.propose([_req([1, 2, 3, 4, 5])], [3]) == [[]]
    assert drafter.propose([_req([7])], [3]) == [[]]
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramDrafter(3, 2)


def test_accept_matching_takes_the_longest_agreeing_prefix():
    assert accept_matching([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_matching([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept_matching([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accept_matching([], [4]) == 0


def test_requests_with_per_token_state_do_not_speculate():
    assert _req([1], **GREEDY).can_speculate
    assert _req([1], temperature=0.7, top_p=0.9).can_speculate
    assert not _req([1], frequency_penalty=0.5, **GREEDY).can_speculate
    assert not _req([1], logit_bias={3: 1.0}, **GREEDY).can_speculate
    assert not _req([1], min_tokens=4, **GREEDY).can_speculate
    logprobs = _req([1], **GREEDY)
    logprobs.top_logprobs = 2
    assert not logprobs.can_speculate


def test_stats_count_positions_and_accept_lengths():
    stats = SpeculationStats()
    stats.record(3, 3)
    stats.record(3, 1)
    stats.record(2, 0)
    assert (stats.verifies, stats.drafted, stats.accepted) == (3, 8, 4)
    assert stats.proposed_at == [3, 3, 2]
    assert stats.accepted_at == [2, 1, 1]
    assert stats.accept_lengths == [1, 1, 0, 1]  # verifications gaining 1, 2, 3, 4 tokens
    assert stats.mean_accepted == pytest.approx(4 / 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_num_steps": 3}, "need --speculative-algorithm"),
        (
            {
                "speculative_algorithm": "ngram",
                "speculative_num_steps": 3,
                "speculative_num_draft_tokens": 3,
            },
            "must be --speculative-num-steps \\+ 1",
        ),
        ({"speculative_algorithm": "ngram", "speculative_num_steps": 0}, ">= 1"),
        (
            {"speculative_algorithm": "ngram", "speculative_ngram_max_match_window_size": 1},
            "is below --speculative-ngram-min-match-window-size",
        ),
        ({"speculative_algorithm": "eagle9"}, "--speculative-algorithm must be one of"),
    ],
)
def test_bad_speculative_flags_are_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**flags).validate()


def test_num_draft_tokens_gives_the_steps():
    assert ServerArgs(speculative_num_draft_tokens=5).speculative_steps == 4
    assert ServerArgs(speculative_num_steps=2).speculative_steps == 2


# ---- the real model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_plain() -> Engine:
    return Engine(device="cpu", max_total_tokens=4096, max_running_requests=8)


@pytest.fixture(scope="module")
def smollm2_ngram() -> Engine:
    return Engine(
        device="cpu", max_total_tokens=4096, max_running_requests=8, speculative_algorithm="ngram"
    )


def test_smollm2_repeating_a_passage_equals_plain_and_accepts_most_drafts(
    smollm2_plain, smollm2_ngram
):
    ids = smollm2_plain.encode_chat(
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
    )
    params = {"max_new_tokens": 48, **GREEDY}
    plain = smollm2_plain.generate(input_ids=ids, sampling_params=params)
    spec = smollm2_ngram.generate(input_ids=ids, sampling_params=params)
    assert spec["output_ids"] == plain["output_ids"]
    assert spec["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    meta = spec["meta_info"]
    assert meta["spec_accept_length"] == pytest.approx(
        (meta["spec_verify_ct"] + meta["spec_accepted_drafts"]) / meta["spec_verify_ct"], abs=1e-3
    )
    # the prefill gives the first token, each verify step one plus the drafts it accepts (the
    # last step's beyond an end are dropped)
    assert meta["spec_verify_ct"] + meta["spec_accepted_drafts"] + 1 >= len(spec["output_ids"])
    assert meta["spec_verify_ct"] + 1 < len(spec["output_ids"])
    assert meta["spec_accept_length"] > 1.5
    assert "spec_verify_ct" not in plain["meta_info"]
    stats = smollm2_ngram.scheduler.speculation.stats
    assert stats.accepted / stats.drafted > 0.4
    verify = smollm2_ngram.runner.forward_stats.phases["verify"]
    assert verify.eager < len(spec["output_ids"]) * 0.7  # several tokens a step
    assert smollm2_ngram.runner.forward_stats.phases["decode"].eager == 0
    assert_kv_released(smollm2_ngram)


def test_smollm2_sampled_requests_equal_plain_sampling_with_their_seeds(
    smollm2_plain, smollm2_ngram
):
    """A verify step keeps a draft when it is the token the request's seeded draw at that
    output index picks: the output is plain sampling's, token for token, for every seed."""
    ids = smollm2_plain.encode_chat(
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
    )
    accepted = 0
    for seed in range(4):
        params = {"max_new_tokens": 32, "temperature": 0.7, "top_p": 0.95, "seed": seed}
        plain = smollm2_plain.generate(input_ids=ids, sampling_params=params)
        spec = smollm2_ngram.generate(input_ids=ids, sampling_params=params)
        assert spec["output_ids"] == plain["output_ids"], seed
        accepted += spec["meta_info"]["spec_accepted_drafts"]
    assert accepted > 0
    assert_kv_released(smollm2_ngram)


def test_smollm2_several_prompts_at_once_equal_plain(smollm2_plain, smollm2_ngram):
    prompts = [
        f"Copy this sentence twice: {PASSAGE[:60]}",
        "Count from one to twenty: one, two, three,",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    ]
    params = {"max_new_tokens": 32, **GREEDY}
    plain = smollm2_plain.generate(prompts, params)
    spec = smollm2_ngram.generate(prompts, params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert_kv_released(smollm2_ngram)


# ---- continuous batching on a tiny checkpoint -----------------------------------------------


def _engine(path: str, **kwargs) -> Engine:
    return Engine(model_path=path, device="cpu", **{"max_total_tokens": 2000, **kwargs})


def _params(i: int) -> SamplingParams:
    """A mix: mostly greedy (with stop ids or small budgets), one sampled, one with logprobs."""
    base = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0.0}
    if i == 2:
        base.update(temperature=0.8, top_p=0.9)
    if i == 3:
        base.update(max_new_tokens=5)
    return SamplingParams(**base)


def _run(engine: Engine, abort: int | None = None) -> list[Req]:
    """The prompts arrive in waves while earlier ones decode; `abort` is cancelled mid-run."""
    sched = engine.scheduler
    reqs = [
        Req(f"r{i}", p, _params(i), 100 + i, _params(i).max_new_tokens)
        for i, p in enumerate(PROMPTS)
    ]
    reqs[5].top_logprobs = 2
    for start, end in ((0, 3), (3, 6), (6, len(reqs))):
        if abort is not None and start == 6:
            assert sched.abort(f"r{abort}") is reqs[abort]
        for req in reqs[start:end]:
            sched.add(req)
        for _ in range(3):
            sched.step()
    sched.run_to_completion()
    return reqs


@pytest.fixture(scope="module")
def plain_run(tiny_llama3) -> list[Req]:
    return _run(_engine(tiny_llama3, disable_overlap_schedule=True), abort=4)


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"disable_radix_cache": True},
        {"speculative_num_steps": 5, "speculative_ngram_min_match_window_size": 1},
        {"max_total_tokens": 160, "max_running_requests": 8},  # retraction
    ],
    ids=["default", "no-prefix-cache", "k5-window1", "tiny-kv"],
)
def test_tiny_model_batches_equal_plain_decoding(tiny_llama3, plain_run, flags):
    engine = _engine(tiny_llama3, speculative_algorithm="ngram", **flags)
    reqs = _run(engine, abort=4)
    for i, (req, plain) in enumerate(zip(reqs, plain_run, strict=True)):
        assert req.finish_reason == plain.finish_reason, i
        if i != 4:
            assert req.output_ids == plain.output_ids, i
    stats = engine.scheduler.speculation.stats
    assert stats.drafted > 0 and stats.accepted > 0
    if "max_total_tokens" in flags:
        assert engine.scheduler.num_retractions > 0
    assert_kv_released(engine)


def test_stops_inside_an_accepted_run_end_at_the_right_token(smollm2_plain, smollm2_ngram):
    ids = smollm2_plain.encode_chat(
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
    )
    free = smollm2_plain.generate(input_ids=ids, sampling_params={"max_new_tokens": 40, **GREEDY})
    out, text = free["output_ids"], free["text"]
    stop_at = next(i for i in range(12, len(out)) if out[i] not in out[:i])  # a first occurrence
    word = text.split()[6]
    cases = [
        {"stop_token_ids": [out[stop_at]]},
        {"max_new_tokens": stop_at},
        {"stop": [word]},
    ]
    stats = smollm2_ngram.scheduler.speculation.stats
    for extra in cases:
        params = {"max_new_tokens": 40, **GREEDY, **extra}
        accepted = stats.accepted
        a = smollm2_plain.generate(input_ids=ids, sampling_params=params)
        b = smollm2_ngram.generate(input_ids=ids, sampling_params=params)
        assert b["output_ids"] == a["output_ids"], extra
        assert b["text"] == a["text"], extra
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"], extra
        assert stats.accepted > accepted  # drafts were accepted on the way to the stop
    assert_kv_released(smollm2_ngram)


# ---- over HTTP ------------------------------------------------------------------------------


def test_http_stream_and_not_equal_plain_server_and_metrics_count(http_server, server_factory):
    spec = server_factory(*HTTP_SERVER_FLAGS, "--speculative-algorithm", "ngram")
    body = {
        "messages": [{"role": "user", "content": f"Repeat word for word: {PASSAGE}"}],
        "max_tokens": 40,
        "temperature": 0,
    }
    with httpx.Client(timeout=TIMEOUT_S) as c:
        url = "/v1/chat/completions"
        plain = c.post(http_server.base_url + url, json=body).json()
        whole = c.post(spec.base_url + url, json=body).json()
        chunks = []
        with c.stream("POST", spec.base_url + url, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        native = c.post(
            spec.base_url + "/generate",
            json={"text": PASSAGE, "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
        ).json()
        metrics = c.get(spec.base_url + "/metrics").text
    assert native["meta_info"]["spec_verify_ct"] >= 1
    text = plain["choices"][0]["message"]["content"]
    assert whole["choices"][0]["message"]["content"] == text
    assert whole["usage"] == plain["usage"]
    streamed = "".join(
        ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]
    )
    assert streamed == text
    # the tokens a verify step accepts go out together: fewer chunks than tokens
    pieces = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")]
    assert len(pieces) < whole["usage"]["completion_tokens"]
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith("replaylm_spec_") and " " in line
    }
    assert values["replaylm_spec_accepted_tokens"] > 0
    assert values["replaylm_spec_verify_steps"] < 2 * whole["usage"]["completion_tokens"]
    assert values['replaylm_spec_position_acceptance_ratio{position="1"}'] > 0
