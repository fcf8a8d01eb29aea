"""Structured-output constraints as requests ask for them (OpenAI's `response_format`, SGLang's
`json_schema` / `regex` / `ebnf`, vLLM's `structured_outputs` and older `guided_*` fields, a
forced tool call): each a `Constraint` that names the request field it came from, so that what
goes wrong with it (a second constraint, a grammar the engine refuses) is reported there."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from replaylm.runtime.errors import RequestError

JSON_OBJECT = json.dumps({"type": "object"})  # the schema of `json_object`: any JSON object
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/")


@dataclass(frozen=True)
class Constraint:
    """`text` for the SamplingParams field `kind` (json_schema, regex, ebnf or
    structural_tag), asked for by the request field `param`."""

    param: str
    kind: str
    text: str

    @classmethod
    def grammar(cls, param: str, kind: str, value: str | dict[str, Any] | bool) -> Constraint:
        """A grammar sent as text, or (a JSON schema) as a JSON value."""
        return cls(param, kind, value if isinstance(value, str) else json.dumps(value))

    @classmethod
    def choice(cls, param: str, choices: list[str]) -> Constraint:
        """Exactly one of `choices`, as a regex."""
        escaped = ("".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in s) for s in choices)
        return cls(param, "regex", "(" + "|".join(escaped) + ")")

    @classmethod
    def structural_tag(cls, param: str, tag: str | dict[str, Any]) -> Constraint:
        """An xgrammar structural tag (JSON text or value). The older form SGLang and vLLM take
        too, `structures` (each a `begin`, a `schema` and an `end`) behind `triggers`, becomes
        the `triggered_tags` format xgrammar converts it to; the engine reports what is invalid."""
        value = _json_value(tag) if isinstance(tag, str) else tag
        structures = value.get("structures") if isinstance(value, dict) else None
        if isinstance(structures, list):
            tags = [
                {
                    "type": "tag",
                    "begin": s.get("begin"),
                    "content": {"type": "json_schema", "json_schema": s.get("schema")},
                    "end": s.get("end"),
                }
                for s in structures
                if isinstance(s, dict)
            ]
            triggered = {"type": "triggered_tags", "triggers": value.get("triggers"), "tags": tags}
            tag = {"type": "structural_tag", "format": triggered}
        return cls.grammar(param, "structural_tag", tag)


def _json_value(text: str) -> Any:
    """`text` parsed, or None where it is no JSON (left for the engine to report)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def whitespace_refused(param: str) -> RequestError:
    """The error for `param`, a request to shape the whitespace of JSON output."""
    return RequestError(
        f"{param} is not supported: replaylm's JSON grammars allow any whitespace between tokens",
        param,
    )


def only_one(given: list[Constraint]) -> Constraint | None:
    """The one constraint of `given`; RequestError naming the second where there are more."""
    if len(given) > 1:
        raise RequestError(
            f"{given[1].param} cannot be combined with {given[0].param}: give at most one "
            "structured-output constraint",
            given[1].param,
        )
    return given[0] if given else None


@contextlib.contextmanager
def reported_under(constraint: Constraint | None) -> Iterator[None]:
    """Report the engine's errors about `constraint`'s grammar (which name its SamplingParams
    field) under the request field that asked for it."""
    try:
        yield
    except RequestError as err:
        if constraint is not None and err.param == constraint.kind != constraint.param:
            raise RequestError(f"{constraint.param}: {err}", constraint.param, err.code) from err
        raise
