"""Structured output through a real server (built-in SmolLM2 on the CPU, see conftest.py): the
native /generate route's `json_schema`, a 400 naming the field for an invalid grammar or a model
without a tokenizer, the grammar engine's metrics, grammars kept by the scheduler across requests
and dropped for newer ones, and bench_serving's structured-output workload end to end."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from replaylm.structured.cache import GRAMMARS_KEPT

from http_helpers import TIMEOUT_S, TINY_API_KEY, run_bench_serving, samples

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}


def _grammar_metrics(http: httpx.Client) -> tuple[float, float]:
    values = samples(http.get("/metrics").text)
    return values["replaylm_grammar_steps"], values["replaylm_grammar_host_seconds"]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_with_a_json_schema_returns_valid_json(http, stream):
    steps, seconds = _grammar_metrics(http)
    body = {
        "text": "Q: What is the capital of France? Reply in JSON.\nA:",
        "sampling_params": {
            "max_new_tokens": 40,
            "temperature": 0,
            "json_schema": json.dumps(ANSWER),
        },
        "stream": stream,
    }
    if stream:
        with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            events = [
                json.loads(line[len("data: ") :])
                for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        text = "".join(e["text"] for e in events)
        meta = events[-1]["meta_info"]
    else:
        response = http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        text, meta = response.json()["text"], response.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(text), ANSWER)
    after_steps, after_seconds = _grammar_metrics(http)
    assert after_steps >= steps + meta["completion_tokens"] and after_seconds > seconds


@pytest.mark.parametrize(
    ("field", "text"), [("json_schema", '{"type": 3}'), ("regex", "(a"), ("ebnf", "root ::=")]
)
def test_an_invalid_grammar_is_a_400_naming_the_field(http, field, text):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, field: text}}
    response = http.post("/generate", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"invalid {field}: ")
    assert "\n" not in error["message"] and ".cc:" not in error["message"]


def test_a_model_without_a_tokenizer_refuses_a_grammar(tiny_keyed_server):
    keyed = {"Authorization": f"Bearer {TINY_API_KEY}"}
    with httpx.Client(base_url=tiny_keyed_server.base_url, timeout=TIMEOUT_S, headers=keyed) as c:
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}}
        response = c.post("/generate", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "regex"
        plain = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}
        assert c.post("/generate", json=plain).is_success


def test_grammars_the_scheduler_drops_are_sent_again(http):
    """More regexes than the scheduler keeps, each asked for twice, concurrently: the manager
    leaves out the grammars the scheduler holds and sends again those it dropped; a wrong guess
    would fail the request or the scheduler."""
    patterns = [f"{word}: [0-9]{{2}}" for word in ("cat", "dog", "owl", "elk", "bee", "ant")]
    patterns += [f"(yes|no) {i}" for i in range(GRAMMARS_KEPT)]

    def ask(pattern: str) -> str:
        params = {"max_new_tokens": 8, "temperature": 0, "regex": pattern}
        response = http.post("/generate", json={"text": "Answer:", "sampling_params": params})
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["finish_reason"]["type"] == "stop"
        return response.json()["text"]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, patterns * 2))
    for pattern, text in zip(patterns * 2, texts, strict=True):
        assert re.fullmatch(pattern, text), (pattern, text)
    assert http.get("/health").status_code == 200


def test_bench_serving_structured_workload(http_server, tmp_path):
    questions = ["Is the sky blue?", "Is fire cold?", "Is water wet?"]
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": f"Q: {q} Answer in JSON.\nA:"}) + "\n" for q in questions)
    )
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(ANSWER))
    doc = run_bench_serving(
        http_server.base_url,
        tmp_path / "bench.json",
        "--endpoint",
        "generate",
        "--workload",
        "plain",
        "json_schema",
        "--json-schema",
        str(schema),
        "--dataset",
        str(dataset),
        "--dataset-output-len",
        "40",
        "--num-prompts",
        "3",
        "--warmup",
        "0",
        "--max-concurrency",
        "3",
    )
    plain, structured = doc["summary"]
    assert (plain["workload"], structured["workload"]) == ("plain", "json_schema")
    for row in (plain, structured):
        assert row["completed"] == 3 and row["failed"] == 0 and row["output_token_throughput"] > 0
    assert plain["total_output_tokens"] == 3 * 40  # EOS ignored
    assert plain["valid_json"] is None and plain["grammar_steps"] == 0
    assert structured["valid_json"] == 3
    assert structured["grammar_steps"] > 0 and structured["grammar_host_ms_per_step"] > 0
    assert doc["config"]["json_schema"] == ANSWER
    # the result names the dataset by file name: no path of the machine it ran on
    assert (plain["dataset"], structured["dataset"]) == (dataset.name, "json_schema_prompt")
