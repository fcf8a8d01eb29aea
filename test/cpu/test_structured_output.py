"""Structured output (JSON schema, regex, EBNF through xgrammar) on the built-in SmolLM2 on the CPU.

One batch of constrained requests, greedy and sampled, beside plain ones, runs with the overlap
schedule on and off: every output follows its grammar, both schedules give the same tokens (under
overlap a step's tokens are fed to the grammars before the step is applied, exactly once), and
the plain requests' tokens equal those they get alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr
from kv_accounting import assert_kv_released

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.io_struct import TokenizedGenerateReq
from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams
from replaylm.structured.cache import HeldGrammars, LruCache
from replaylm.structured.compiler import GrammarCompiler
from replaylm.structured.grammar import RequestGrammar
from replaylm.structured.loader import GrammarLoader
from replaylm.structured.vocabulary import describe_vocabulary

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
COLOURS = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue"]},
    "minItems": 1,
    "maxItems": 3,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "capital"],
    "additionalProperties": False,
}
SCHEMAS = [
    (PERSON, "Describe a person as JSON with a name and an age."),
    (COLOURS, "List some colours as a JSON array."),
    (CITY, "What is the capital of France? Answer in JSON."),
]
SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}]
REGEX = r"(Yes|No), because [a-z ]{1,20}\."
EBNF = 'root ::= "The answer is " number "."\nnumber ::= [1-9] [0-9]?'
EBNF_AS_REGEX = r"The answer is [1-9][0-9]?\."
PLAIN = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}]  # unconstrained companions
PLAIN_TOKENS = 12


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", max_total_tokens=4096, max_running_requests=16)


def _chat(engine: Engine, question: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": question}])


def _batch(engine: Engine) -> list[tuple[str, list[int], dict]]:
    """(kind, prompt ids, sampling params) of every request of the mixed batch."""
    batch = [
        ("json", _chat(engine, q), {"max_new_tokens": 48, "json_schema": json.dumps(s), **p})
        for s, q in SCHEMAS
        for p in SAMPLINGS
    ]
    yes_no = _chat(engine, "Is Paris in France?")
    batch += [("regex", yes_no, {"max_new_tokens": 32, "regex": REGEX, **p}) for p in SAMPLINGS[:2]]
    batch.append(("ebnf", _chat(engine, "What is 2 + 3?"), {"max_new_tokens": 16, "ebnf": EBNF}))
    cut = {"max_new_tokens": 4, "json_schema": json.dumps(PERSON), "temperature": 0.0}
    batch.append(("cut", _chat(engine, SCHEMAS[0][1]), cut))
    once = _chat(engine, "Once upon a time")
    batch += [
        ("plain", once, {"max_new_tokens": PLAIN_TOKENS, "ignore_eos": True, **p}) for p in PLAIN
    ]
    return batch


@pytest.fixture(scope="module")
def runs(engine) -> dict[bool, list[dict]]:
    """The batch's results with the overlap schedule on (True) and off (False)."""
    batch = _batch(engine)
    results = {}
    for overlap in (True, False):
        engine.scheduler.overlap = overlap
        results[overlap] = engine.generate(
            input_ids=[ids for _, ids, _ in batch], sampling_params=[p for _, _, p in batch]
        )
    engine.scheduler.overlap = True
    return results


@pytest.mark.parametrize("overlap", [True, False])
def test_every_constrained_output_follows_its_grammar(engine, runs, overlap):
    batch = _batch(engine)
    for (kind, _, params), out in zip(batch, runs[overlap], strict=True):
        reason = out["meta_info"]["finish_reason"]
        if kind == "plain":
            continue
        if kind == "cut":  # max_new_tokens reached mid-object: cut short, not an error
            assert reason["type"] == "length" and out["meta_info"]["completion_tokens"] == 4
            with pytest.raises(json.JSONDecodeError):
                json.loads(out["text"])
            continue
        assert reason["type"] == "stop" and reason["matched"] in engine.eos_token_ids, out
        if kind == "json":
            jsonschema.validate(json.loads(out["text"]), json.loads(params["json_schema"]))
        else:
            assert re.fullmatch(REGEX if kind == "regex" else EBNF_AS_REGEX, out["text"]), out
    assert engine.scheduler.stats().grammar_steps > 0
    assert engine.scheduler.stats().grammar_host_s > 0


def test_three_ranks_generate_what_one_rank_does(engine, runs):
    """The mixed batch through an Engine split over 3 ranks (SmolLM2's 9 heads and 3 KV heads):
    rank 0 sends each grammar once, serialized, and every rank's matcher masks alike, so the
    outputs are one rank's."""
    batch = _batch(engine)
    split = Engine(device="cpu", max_total_tokens=4096, max_running_requests=16, tp_size=3)
    try:
        out = split.generate(
            input_ids=[ids for _, ids, _ in batch], sampling_params=[p for _, _, p in batch]
        )
        loader = split._grammars_for_ranks().loader
        assert loader.deserialized == len(SCHEMAS) + 2  # each constraint once (PERSON twice)
    finally:
        split.shutdown()
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in runs[True]]


def test_overlap_changes_no_token(runs):
    assert [o["output_ids"] for o in runs[True]] == [o["output_ids"] for o in runs[False]]


def test_plain_companions_are_unchanged(engine, runs):
    batch = _batch(engine)
    plain = [(i, ids, p) for i, (kind, ids, p) in enumerate(batch) if kind == "plain"]
    for i, ids, params in plain:
        alone = engine.generate(input_ids=ids, sampling_params=params)
        assert runs[True][i]["output_ids"] == alone["output_ids"]
        assert len(alone["output_ids"]) == PLAIN_TOKENS


@pytest.mark.parametrize(
    ("field", "text", "wanted"),
    [
        ("json_schema", '{"type": "objekt"}', 'Unsupported type "objekt"'),
        ("json_schema", "{not json", "Failed to parse JSON"),
        ("regex", "[a-", "Unclosed '['"),
        ("ebnf", "root ::= digit", 'Rule "digit" is not defined'),
        ("structural_tag", "{}", "must have a format field"),
    ],
)
def test_an_invalid_constraint_is_a_one_line_error_naming_the_field(engine, field, text, wanted):
    with pytest.raises(ValueError, match=f"^invalid {field}: ") as err:
        engine.generate("Hi", {field: text})
    message = str(err.value)
    assert wanted in message and "\n" not in message
    assert ".cc:" not in message and "Check failed" not in message  # xgrammar's log prefix
    assert not engine.scheduler.has_work


def test_a_rejected_token_aborts_its_request_only(engine):
    """A grammar engine that disagrees with its own mask (here: a matcher moved on behind the
    scheduler's back while a decode step is in flight) ends that request with an abort naming
    the token; the scheduler and the other request go on."""
    compiler = GrammarCompiler.for_tokenizer(engine.tokenizer, engine.runner.config.vocab_size)
    assert compiler is not None
    compiled = compiler.compile_grammar(SamplingParams(regex="[0-9]{6}"))
    assert compiled is not None
    eos = engine.eos_token_ids
    # the prefix cache off: with it, the second request of the same prompt would wait a step
    # to find the first one's prompt cached, and the steps below would differ
    sched = Scheduler(engine.runner, eos, None, 256, None, overlap=True, prefix_cache=False)
    prompt = _chat(engine, "Give me a six-digit number.")
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    tampered, honest = (
        Req(
            rid, prompt, params, 0, 16, grammar=RequestGrammar.start(compiled, engine.eos_token_ids)
        )
        for rid in ("tampered", "honest")
    )
    sched.add(tampered)
    sched.add(honest)
    sched.step()  # prefill: each request's first digit, fed and applied
    sched.step()  # a decode step launched: its digits in flight, not fed yet
    assert tampered.grammar is not None and tampered.grammar.fed == len(tampered.output_ids) == 1
    assert tampered.grammar.matcher.accept_string("00000")  # complete: only EOS may follow
    sched.run_to_completion()

    assert tampered.finish_reason is not None and tampered.finish_reason.type == "abort"
    assert "rejected token" in str(tampered.finish_reason.matched)
    assert len(tampered.output_ids) == 1  # the rejected token is not emitted
    assert honest.finish_reason is not None and honest.finish_reason.type == "stop"
    text = engine.tokenizer.decode(honest.output_ids, skip_special_tokens=True)
    assert re.fullmatch("[0-9]{6}", text)
    assert honest.grammar is not None and honest.grammar.fed == len(honest.output_ids)  # once each
    assert_kv_released(engine)


def test_a_larger_model_vocabulary_never_allows_its_padding(engine):
    """The model's vocabulary may exceed the tokenizer's (padded logits): those ids are empty
    tokens no grammar allows, and a grammar compiled in one process loads in another."""
    description = describe_vocabulary(engine.tokenizer)
    assert description is not None
    size = len(engine.tokenizer) + 64
    compiler = GrammarCompiler(description, size)
    params = SamplingParams(json_schema='{"type": "string"}')
    serialized = compiler.compile(params)
    assert serialized is not None and compiler.compile(SamplingParams()) is None
    assert params.constraint is not None
    loader = GrammarLoader(size, engine.eos_token_ids)
    with pytest.raises(RuntimeError, match="before the vocabulary"):
        loader.load(params.constraint, serialized)
    grammar = loader.load(params.constraint, serialized, description)  # the first brings it
    assert grammar.matcher.accept_string('"ab')  # inside a string: almost any token fits
    bitmask = xgr.allocate_token_bitmask(1, size)
    grammar.matcher.fill_next_token_bitmask(bitmask)
    allowed = [(int(bitmask[0, i // 32]) >> (i % 32)) & 1 for i in range(size)]
    assert sum(allowed[: len(engine.tokenizer)]) > 1000
    assert not any(allowed[len(engine.tokenizer) :])


def test_an_lru_cache_drops_the_least_recently_used():
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert "b" not in cache and cache.get("b") is None
    assert (cache.get("a"), cache.get("c"), len(cache)) == (1, 3, 2)
    assert (cache.hits, cache.misses) == (3, 1)


def test_a_held_grammar_is_neither_serialized_nor_sent_nor_deserialized_again(engine):
    """The manager's side (compiler, HeldGrammars) and the scheduler's (GrammarLoader), fed the
    requests in one order as the pipe does: a grammar crosses only when the loader lacks it (new,
    or dropped for newer ones), the two sides agree through every drop, and the requests of one
    grammar each start a matcher of their own over the same compiled grammar."""
    description = describe_vocabulary(engine.tokenizer)
    assert description is not None
    vocab_size = engine.runner.config.vocab_size
    compiler = GrammarCompiler(description, vocab_size)
    # the loader learns the vocabulary from the first grammar sent, as a server's does
    held, loader = (
        HeldGrammars(capacity=2),
        GrammarLoader(vocab_size, engine.eos_token_ids, capacity=2),
    )
    patterns = {"a": "[0-9]{3}", "b": "(yes|no)", "c": "[a-z]{2}"}
    order = ["a", "a", "b", "a", "c", "b", "a", "a"]  # "c" drops "b"; "b" then drops "a"
    sent, vocabularies, grammars = [], [], []
    for name in order:
        params = SamplingParams(regex=patterns[name])
        constraint = params.constraint
        assert constraint is not None
        msg = TokenizedGenerateReq(
            ["r"], [1], params, [0], 4, None, grammar=compiler.compile(params)
        )
        msg = held.outgoing(msg, description)
        grammars.append(loader.load(constraint, msg.grammar, msg.grammar_vocabulary))
        held.sent(constraint)
        sent.append(msg.grammar is not None)
        vocabularies.append(msg.grammar_vocabulary is not None)
    assert sent == [True, False, True, False, True, True, True, False]
    assert vocabularies == [True] + [False] * 7
    assert loader.deserialized == sum(sent) == 5
    # the manager keeps more serialized grammars than the loader here: one serialization each
    assert (compiler.serialized.misses, compiler.serialized.hits) == (3, 5)
    first, second = grammars[0], grammars[1]
    assert first.matcher.accept_string("12") and not first.matcher.accept_string("y")
    assert second.matcher.accept_string("9")  # at the start still: its own matcher
    with pytest.raises(RuntimeError, match="unknown regex"):
        loader.load(("regex", "[0-9]{4}"), None)
