"""The OpenAI server's sampling features, exercised against one running server (SmolLM2): what
test_mode_cells_server.py checks under every decode x prefill CUDA-graph cell. Each feature's
effect is recorded here; the test compares it with the definition and with the all-eager cell."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema

PENALTY_QUESTIONS = [
    f"List five facts about {t}." for t in ("cats", "rivers", "music", "trains", "salt", "stars")
]
ECHO_PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
BIASED_WORD = " banana"


@dataclass
class CellFeatures:
    n3_greedy: list[str]  # the three choices of one greedy n=3 request
    echo_text: str  # an echoed prompt (max_tokens 0)
    echo_logprobs: list[float | None]  # its prompt tokens' logprobs
    biased: str  # 4 greedy tokens with BIASED_WORD's token biased by +100
    json_outputs: list[str]  # answers under PERSON_SCHEMA
    tool_calls: list[dict[str, Any]]  # tool_calls of a request forcing get_weather
    tool_finish: str
    penalized: list[str]  # greedy answers with presence/frequency/repetition penalties on
    unpenalized: list[str]  # the same requests without them
    streamed: str  # one greedy answer streamed, its deltas joined
    unstreamed: str  # the same request without streaming


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(path, json=body)
    assert r.status_code == 200, (path, body, r.text)
    return r.json()


async def _streamed(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    parts = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


async def _features(base_url: str, timeout_s: float) -> CellFeatures:
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:
        tokens = await _post(
            client, "/tokenize", {"prompt": BIASED_WORD, "add_special_tokens": False}
        )
        (biased_id,) = tokens["tokens"]  # one token in SmolLM2's vocabulary
        story = "Tell me a short story about a lighthouse."
        penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
        results = await asyncio.gather(
            _post(client, "/v1/chat/completions", _chat(story, n=3, max_tokens=24)),
            _post(
                client,
                "/v1/completions",
                {"prompt": ECHO_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1},
            ),
            _post(
                client,
                "/v1/completions",
                {
                    "prompt": "My favourite fruit is",
                    "max_tokens": 4,
                    "temperature": 0,
                    "logit_bias": {str(biased_id): 100},
                },
            ),
            *(
                _post(
                    client,
                    "/v1/chat/completions",
                    _chat(
                        f"Make up a person from {place} as JSON.",
                        max_tokens=64,
                        response_format={
                            "type": "json_schema",
                            "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
                        },
                    ),
                )
                for place in ("Paris", "Tokyo", "Lima", "Oslo")
            ),
            _post(
                client,
                "/v1/chat/completions",
                _chat(
                    "What is the weather like in Rome?",
                    max_tokens=48,
                    tools=[WEATHER_TOOL],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                ),
            ),
            *(
                _post(client, "/v1/chat/completions", _chat(q, max_tokens=32, **penalties))
                for q in PENALTY_QUESTIONS
            ),
            *(
                _post(client, "/v1/chat/completions", _chat(q, max_tokens=32))
                for q in PENALTY_QUESTIONS
            ),
            _post(client, "/v1/chat/completions", _chat(story, max_tokens=24)),
            _streamed(client, _chat(story, max_tokens=24)),
        )
    n3, echo, biased, *rest = results
    json_answers, (tool,), rest = rest[:4], rest[4:5], rest[5:]
    k = len(PENALTY_QUESTIONS)
    penalized, unpenalized, (unstreamed, streamed) = rest[:k], rest[k : 2 * k], rest[-2:]
    tool_choice = tool["choices"][0]
    return CellFeatures(
        n3_greedy=[c["message"]["content"] for c in n3["choices"]],
        echo_text=echo["choices"][0]["text"],
        echo_logprobs=echo["choices"][0]["logprobs"]["token_logprobs"],
        biased=biased["choices"][0]["text"],
        json_outputs=[a["choices"][0]["message"]["content"] for a in json_answers],
        tool_calls=tool_choice["message"].get("tool_calls") or [],
        tool_finish=tool_choice["finish_reason"],
        penalized=[a["choices"][0]["message"]["content"] for a in penalized],
        unpenalized=[a["choices"][0]["message"]["content"] for a in unpenalized],
        streamed=streamed,
        unstreamed=unstreamed["choices"][0]["message"]["content"],
    )


def cell_features(base_url: str, timeout_s: float = 120.0) -> CellFeatures:
    return asyncio.run(_features(base_url, timeout_s))


def check_definitions(got: CellFeatures) -> None:
    """What each feature promises, whatever the cell."""
    assert len(got.n3_greedy) == 3 and len(set(got.n3_greedy)) == 1, got.n3_greedy
    assert got.echo_text == ECHO_PROMPT
    assert got.echo_logprobs[0] is None and all(lp is not None for lp in got.echo_logprobs[1:])
    assert got.biased == BIASED_WORD * 4
    for text in got.json_outputs:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    (call,) = got.tool_calls
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(
        json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"]
    )
    assert got.tool_finish == "tool_calls"
    assert got.streamed == got.unstreamed
    # the penalties act under every graph mode (their values are checked against a torch
    # reference in test_penalties_cuda.py): most penalized answers part from the plain ones
    changed = sum(a != b for a, b in zip(got.penalized, got.unpenalized, strict=True))
    assert changed >= len(PENALTY_QUESTIONS) - 2, (got.penalized, got.unpenalized)


def compare_with_eager(got: CellFeatures, eager: CellFeatures) -> None:
    """Prompt logprobs equal the eager cell's up to bf16 rounding: logits of magnitude 16-32
    are rounded to multiples of 0.125, and batch shapes (padding, other requests) change which
    way; each may differ by up to three such steps, and on average by far less. (Greedy answers
    across cells are compared, near-ties accounted for, by test_cell_matches_eager.)"""
    gaps = [
        abs(a - b)
        for a, b in zip(got.echo_logprobs, eager.echo_logprobs, strict=True)
        if a is not None and b is not None
    ]
    assert max(gaps) <= 0.375 and sum(gaps) / len(gaps) < 0.1, gaps
