"""Structured output on CUDA: the built-in SmolLM2 in bfloat16 with decode CUDA graphs and the
overlap schedule on (the bitmask filled on the host while the graph replays, copied and applied
on the device). Every JSON-schema output validates, greedy and sampled, in a batch beside a plain
request."""

from __future__ import annotations

import json

import jsonschema
import pytest

from replaylm.entrypoints.engine import Engine

pytestmark = pytest.mark.gpu

SCHEMAS = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
        },
        "Describe a person as JSON with a name and an age.",
    ),
    (
        {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 5,
        },
        "List some colours as a JSON array.",
    ),
    (
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "capital": {"type": "boolean"}},
            "required": ["city", "capital"],
            "additionalProperties": False,
        },
        "What is the capital of France? Answer in JSON.",
    ),
]
SEEDS = range(8)
PLAIN = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cuda", dtype="bfloat16", max_total_tokens=16384)


def test_json_schema_outputs_validate_with_graphs_and_overlap(engine):
    assert not engine.server_args.disable_overlap_schedule
    prompts, params, schemas = [], [], []
    for schema, question in SCHEMAS:
        ids = engine.encode_chat([{"role": "user", "content": question}])
        for seed in [None, *SEEDS]:
            sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
            prompts.append(ids)
            params.append({"max_new_tokens": 160, "json_schema": json.dumps(schema), **sampling})
            schemas.append(schema)
    plain_ids = engine.encode_chat([{"role": "user", "content": "Tell me a story."}])
    graphs_before = engine.runner.forward_stats.phases["decode"].graph

    outs = engine.generate(input_ids=[*prompts, plain_ids], sampling_params=[*params, PLAIN])

    assert engine.runner.forward_stats.phases["decode"].graph > graphs_before  # graphs replayed
    for out, schema in zip(outs, schemas, strict=False):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
    assert len(outs[-1]["output_ids"]) == PLAIN["max_new_tokens"]
    stats = engine.scheduler.stats()
    assert stats.grammar_steps > 0
    print(f"grammar host time: {stats.grammar_host_s / stats.grammar_steps * 1e3:.3f} ms/step")
