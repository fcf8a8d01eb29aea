"""Speculative decoding with the n-gram drafter and with a draft model: the output equals plain
decoding's, greedy and sampled (seed for seed), on the real SmolLM2 (repeating a passage: most
n-gram drafts accepted; SmolLM2 as its own draft model: all accepted) and on tiny checkpoints
under continuous batching (requests joining, penalised and logprob requests beside speculating
ones, stops and token budgets inside an accepted run, an abort, retraction under a tiny KV pool,
the prefix cache on and off; a random draft model of another architecture: next to nothing
accepted), every KV slot of both models given back; sampled second tokens against the target's
exact distribution (a chi-square test); the drafters, the acceptance rule and the flags'
checks alone."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from kv_accounting import assert_kv_released
from transformers import AutoModelForCausalLM

from replaylm.entrypoints.engine import Engine
from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs
from replaylm.speculative.drafter import accept_matching
from replaylm.speculative.ngram import NgramDrafter
from replaylm.speculative.stats import SpeculationStats

from http_helpers import HTTP_SERVER_FLAGS, TIMEOUT_S
from tiny_checkpoints import write_tiny_checkpoint

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
    assert not _req([1], allowed_token_ids=[3, 4], **GREEDY).can_speculate
    assert not _req([1], banned_token_ids=[3], **GREEDY).can_speculate
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
        ({"speculative_algorithm": "draft_model"}, "needs --speculative-draft-model-path"),
        ({"speculative_algorithm": "eagle3"}, "needs --speculative-draft-model-path"),
        (
            {"speculative_algorithm": "ngram", "speculative_draft_model_path": "x"},
            "needs --speculative-algorithm draft_model, eagle or eagle3",
        ),
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
    for seed in range(2):
        params = {"max_new_tokens": 24, "temperature": 0.7, "top_p": 0.95, "seed": seed}
        plain = smollm2_plain.generate(input_ids=ids, sampling_params=params)
        spec = smollm2_ngram.generate(input_ids=ids, sampling_params=params)
        assert spec["output_ids"] == plain["output_ids"], seed
        accepted += spec["meta_info"]["spec_accepted_drafts"]
    assert accepted > 0
    assert_kv_released(smollm2_ngram)


def test_constrained_and_penalised_requests_decode_plainly_beside_speculating_ones(
    smollm2_plain, smollm2_ngram
):
    """A request with a grammar, a penalty or banned ids takes no drafts (its mask or penalty
    changes with every token): one token a step inside the verify batches, its output plain
    decoding's."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    repeat = f"Repeat this passage word for word:\n\n{PASSAGE}"
    chats = [
        smollm2_plain.encode_chat([{"role": "user", "content": text}])
        for text in ("Describe a person as JSON.", repeat, repeat, repeat)
    ]
    params = [
        {"max_new_tokens": 32, **GREEDY, "json_schema": json.dumps(schema)},
        {"max_new_tokens": 32, **GREEDY, "frequency_penalty": 0.5},
        {"max_new_tokens": 32, **GREEDY},
        {"max_new_tokens": 32, **GREEDY, "banned_token_ids": [0]},
    ]
    plain = smollm2_plain.generate(input_ids=chats, sampling_params=params)
    spec = smollm2_ngram.generate(input_ids=chats, sampling_params=params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert [spec[i]["meta_info"]["spec_accepted_drafts"] for i in (0, 1, 3)] == [0, 0, 0]
    assert spec[2]["meta_info"]["spec_accepted_drafts"] > 0
    _assert_all_released(smollm2_ngram)


def test_smollm2_as_its_own_draft_model_is_always_right(smollm2_plain):
    engine = Engine(
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=8,
        speculative_algorithm="draft_model",
        speculative_draft_model_path=resolve_model_path("smollm2-135m-instruct"),
        speculative_num_steps=4,
    )
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = {"max_new_tokens": 16, **GREEDY}
    plain = smollm2_plain.generate(prompts, params)
    spec = engine.generate(prompts, params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    stats = engine.scheduler.speculation.stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted
    assert all(o["meta_info"]["spec_accept_length"] > 3 for o in spec)
    _assert_all_released(engine)


# ---- continuous batching on a tiny checkpoint -----------------------------------------------


def _assert_all_released(engine: Engine) -> None:
    """The target's KV (kv_accounting) and the draft model's, if any."""
    assert_kv_released(engine)
    draft = engine.draft_runner
    if draft is not None:
        assert draft.kv.allocator.available_size() == draft.kv.size
        assert draft.kv.req_to_token.available_size() == draft.kv.max_requests


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


@pytest.fixture(scope="module")
def tiny_qwen3_draft(tmp_path_factory) -> str:
    """A random tiny Qwen3 of the tiny Llama's vocabulary: a draft that is rarely right."""
    path = tmp_path_factory.mktemp("tiny_qwen3_draft")
    write_tiny_checkpoint("qwen3", path, seed=1)
    return str(path)


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"disable_radix_cache": True},
        {"speculative_num_steps": 5, "speculative_ngram_min_match_window_size": 1},
        {"max_total_tokens": 160, "max_running_requests": 8},  # retraction
        {"speculative_algorithm": "draft_model", "speculative_draft_model_path": "self"},
        {
            "speculative_algorithm": "draft_model",
            "speculative_draft_model_path": "self",
            "max_total_tokens": 160,
            "max_running_requests": 8,
        },
    ],
    ids=["default", "no-prefix-cache", "k5-window1", "tiny-kv", "draft-self", "draft-tiny-kv"],
)
def test_tiny_model_batches_equal_plain_decoding(tiny_llama3, plain_run, flags):
    flags = {"speculative_algorithm": "ngram", **flags}
    if flags.get("speculative_draft_model_path") == "self":
        flags["speculative_draft_model_path"] = tiny_llama3
    engine = _engine(tiny_llama3, **flags)
    reqs = _run(engine, abort=4)
    for i, (req, plain) in enumerate(zip(reqs, plain_run, strict=True)):
        assert req.finish_reason == plain.finish_reason, i
        if i != 4:
            assert req.output_ids == plain.output_ids, i
    stats = engine.scheduler.speculation.stats
    assert stats.drafted > 0 and stats.accepted > 0
    if "max_total_tokens" in flags:
        assert engine.scheduler.num_retractions > 0
    if flags["speculative_algorithm"] == "draft_model":  # its own draft: right when greedy
        for i in (0, 1, 6, 7):
            assert reqs[i].spec_verify_ct < len(reqs[i].output_ids) / 2, i
    assert 0 < stats.draft_seconds < 60 and 0 < stats.verify_seconds < 60
    _assert_all_released(engine)


def test_batches_above_speculative_max_bs_decode_plainly(tiny_llama3, plain_run):
    engine = _engine(tiny_llama3, speculative_algorithm="ngram", speculative_max_bs=2)
    reqs = _run(engine, abort=4)
    for i, (req, plain) in enumerate(zip(reqs, plain_run, strict=True)):
        if i != 4:
            assert req.output_ids == plain.output_ids, i
    phases = engine.runner.forward_stats.phases
    assert phases["decode"].eager > 0 and phases["verify"].eager > 0  # above 2 running, below
    _assert_all_released(engine)


def test_a_random_draft_model_is_rarely_right_and_changes_nothing(
    tiny_llama3, plain_run, tiny_qwen3_draft
):
    engine = _engine(
        tiny_llama3,
        speculative_algorithm="draft_model",
        speculative_draft_model_path=tiny_qwen3_draft,
    )
    reqs = _run(engine, abort=4)
    for i, (req, plain) in enumerate(zip(reqs, plain_run, strict=True)):
        if i != 4:
            assert req.output_ids == plain.output_ids, i
    stats = engine.scheduler.speculation.stats
    assert stats.drafted > 50 and stats.accepted / stats.drafted < 0.2
    _assert_all_released(engine)


def test_sampled_second_tokens_follow_the_targets_distribution(tiny_llama3):
    """Rejection sampling, statistically: the target as its own draft model proposes its greedy
    token, kept only when the request's seeded draw there picks it. Over many seeds the second
    output token (the first to come through a verify step) must follow the target's exact
    distribution, computed with transformers: sum over the first token t1 of p(t1) p(t2 | t1),
    each with temperature and top-k applied."""
    temperature, top_k, n = 1.5, 6, 1500
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama3).eval()
    prompt = PROMPTS[3]

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1] / temperature
        kept = logits.topk(top_k)
        return torch.zeros_like(logits).scatter(0, kept.indices, kept.values.softmax(-1))

    first = probs(prompt)
    exact = sum(first[t] * probs([*prompt, t]) for t in first.nonzero().flatten().tolist())
    engine = _engine(
        tiny_llama3,
        speculative_algorithm="draft_model",
        speculative_draft_model_path=tiny_llama3,
        speculative_num_steps=2,
        speculative_max_bs=64,
        max_running_requests=64,
    )
    params = [
        {"max_new_tokens": 3, "temperature": temperature, "top_k": top_k, "seed": seed}
        for seed in range(n)
    ]
    out = engine.generate(input_ids=[prompt] * n, sampling_params=params)
    seconds = torch.tensor([o["output_ids"][1] for o in out])
    seen = torch.bincount(seconds, minlength=exact.shape[0]).double()
    expected = exact.double() * n
    assert seen[expected == 0].sum() == 0  # only tokens top-k allows
    # Pearson's chi-square over the tokens expected 5+ times (the rest pooled), against its
    # 1e-4 critical value (Wilson-Hilferty): a bias toward the drafts would be far above it
    big = expected >= 5
    observed = torch.cat([seen[big], seen[~big & (expected > 0)].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    df = observed.shape[0] - 1
    critical = df * (1 - 2 / (9 * df) + 3.72 * (2 / (9 * df)) ** 0.5) ** 3
    assert chi2 < critical, (chi2, critical, df)
    assert engine.scheduler.speculation.stats.accepted > n / 10  # drafts do come through


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(tiny_llama3):
    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        Engine(
            device="cpu",
            max_total_tokens=1000,
            speculative_algorithm="draft_model",
            speculative_draft_model_path=tiny_llama3,
        )


def test_stops_inside_an_accepted_run_end_at_the_right_token(smollm2_plain, smollm2_ngram):
    ids = smollm2_plain.encode_chat(
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
    )
    free = smollm2_plain.generate(input_ids=ids, sampling_params={"max_new_tokens": 28, **GREEDY})
    out, text = free["output_ids"], free["text"]
    stop_at = next(i for i in range(10, len(out)) if out[i] not in out[:i])  # a first occurrence
    word = text.split()[6]
    cases = [
        {"stop_token_ids": [out[stop_at]]},
        {"max_new_tokens": stop_at},
        {"stop": [word]},
    ]
    stats = smollm2_ngram.scheduler.speculation.stats
    for extra in cases:
        params = {"max_new_tokens": 28, **GREEDY, **extra}
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
    """The front end is the drafter's business only through the scheduler: one drafter (ngram)
    over HTTP stands for all (the draft model's outputs are checked through the Engine)."""
    spec = server_factory(*HTTP_SERVER_FLAGS, "--speculative-algorithm", "ngram")
    body = {
        "messages": [{"role": "user", "content": f"Repeat word for word: {PASSAGE}"}],
        "max_tokens": 20,
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
        # n > 1, sampled with a seed: each choice is the plain server's, choice for choice
        several = {**body, "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 12}
        forked = [
            c.post(base + url, json=several).json()
            for base in (http_server.base_url, spec.base_url)
        ]
        choices = [[ch["message"]["content"] for ch in f["choices"]] for f in forked]
        assert choices[1] == choices[0] and len(choices[0]) == 2
        native = c.post(
            spec.base_url + "/generate",
            json={"text": PASSAGE, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        ).json()
        assert native["meta_info"]["spec_verify_ct"] >= 1
        metrics = c.get(spec.base_url + "/metrics").text
    text = plain["choices"][0]["message"]["content"]
    assert whole["choices"][0]["message"]["content"] == text
    for count in ("prompt_tokens", "completion_tokens"):  # the cache hits may differ
        assert whole["usage"][count] == plain["usage"][count]
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
    assert values["replaylm_spec_verify_steps"] > 0
    assert values["replaylm_spec_draft_tokens"] >= values["replaylm_spec_accepted_tokens"]
    assert values['replaylm_spec_position_acceptance_ratio{position="1"}'] > 0
