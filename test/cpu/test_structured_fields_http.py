"""The structured-output request fields of /v1/completions and /v1/chat/completions through the
real server (conftest.py's `http_server`, the built-in SmolLM2 on the CPU): vLLM's
`structured_outputs` and older `guided_*` fields, and structural tags in every form clients send,
reach the grammar engine (its step count grows) and the answer follows them; the options that
change nothing are taken. Their bad input is in test_http_bad_input.py."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import jsonschema
import pytest

from http_helpers import metric, post_ok

QUESTION = 'What is the capital of France? Reply in JSON as {"city": "<name>"}.'
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
}
CHOICES = ["Lyon", "Nice (city)"]  # a regex's special characters stay literal
GRAMMAR = 'root ::= "yes" | "no"'
# a structural tag in xgrammar's format: the answer is one tag around JSON of SCHEMA
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<city>",
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "</city>",
    },
}


def _json_of_schema(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def _one_of(options: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in options, text

    return check


def _full_match(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text

    return check


def _tagged(text: str) -> None:
    match = re.fullmatch(r"<city>(.*)</city>", text, re.DOTALL)
    assert match, text
    _json_of_schema(match.group(1))


def _answer(http: httpx.Client, route: str, fields: dict) -> str:
    """The greedy answer to QUESTION, which must end within its budget with the grammar engine
    masking its logits (a constraint dropped would leave the engine's step count as it was)."""
    steps = metric(http, "replaylm_grammar_steps")
    body = {"max_tokens": 40, "temperature": 0, **fields}
    if route == "/v1/completions":
        choice = post_ok(http, route, {"prompt": f"Q: {QUESTION}\nA:", **body})["choices"][0]
        text = choice["text"]
    else:
        ask = [{"role": "user", "content": QUESTION}]
        choice = post_ok(http, route, {"messages": ask, **body})["choices"][0]
        text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", choice
    assert metric(http, "replaylm_grammar_steps") > steps
    return text


# (route, request fields, check of the answer)
CASES = {
    "guided_json": ("/v1/chat/completions", {"guided_json": SCHEMA}, _json_of_schema),
    "structured_outputs.json, as text, with the options that change nothing": (
        "/v1/completions",
        {
            "structured_outputs": {
                "json": json.dumps(SCHEMA),
                "disable_additional_properties": True,
                "disable_fallback": True,
                "disable_any_whitespace": False,
            },
            "guided_decoding_backend": "xgrammar",
        },
        _json_of_schema,
    ),
    "structured_outputs.json_object": (
        "/v1/chat/completions",
        {"structured_outputs": {"json_object": True}},
        _json_object,
    ),
    "guided_regex": (
        "/v1/completions",
        {"guided_regex": r"[0-9]{3}-[a-z]{2}"},
        _full_match(r"[0-9]{3}-[a-z]{2}"),
    ),
    "structured_outputs.regex": (
        "/v1/chat/completions",
        {"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} [0-9]"}},
        _full_match(r"[A-Z][a-z]{2,8} [0-9]"),
    ),
    "structured_outputs.choice": (
        "/v1/completions",
        {"structured_outputs": {"choice": CHOICES}},
        _one_of(CHOICES),
    ),
    "guided_grammar": ("/v1/completions", {"guided_grammar": GRAMMAR}, _one_of(["yes", "no"])),
    "structured_outputs.grammar": (
        "/v1/chat/completions",
        {"structured_outputs": {"grammar": GRAMMAR}},
        _one_of(["yes", "no"]),
    ),
    "structural_tag": ("/v1/completions", {"structural_tag": json.dumps(TAG)}, _tagged),
    "structured_outputs.structural_tag": (
        "/v1/completions",
        {"structured_outputs": {"structural_tag": json.dumps(TAG)}},
        _tagged,
    ),
    "response_format structural_tag with a format": (
        "/v1/chat/completions",
        {"response_format": TAG},
        _tagged,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_field_constrains_the_output(http, case):
    route, fields, check = CASES[case]
    check(_answer(http, route, fields))


def _legacy_tag(schema: dict) -> dict:
    """The structural tag's older form: `structures` behind `triggers`."""
    structure = {"begin": "<city>", "schema": schema, "end": "</city>"}
    return {"type": "structural_tag", "structures": [structure], "triggers": ["<city"]}


@pytest.mark.parametrize("in_structured_outputs", [False, True])
def test_the_older_structural_tag_form_is_taken(http, in_structured_outputs):
    """xgrammar's own format has no `structures`: the tag compiles, and its schema's error is
    the one reported, only because the older form is converted to it."""
    route, ask = "/v1/chat/completions", [{"role": "user", "content": "Name a city."}]

    def fields(schema: dict) -> dict:
        tag = _legacy_tag(schema)
        if in_structured_outputs:
            return {"structured_outputs": {"structural_tag": json.dumps(tag)}}
        return {"response_format": tag}

    body = {"messages": ask, "max_tokens": 8, "temperature": 0}
    post_ok(http, route, {**body, **fields(SCHEMA)})
    response = http.post(route, json={**body, **fields({"type": "nope"})})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    param = "structured_outputs.structural_tag" if in_structured_outputs else "response_format"
    assert error["param"] == param
    assert "invalid structural_tag" in error["message"] and "nope" in error["message"]
