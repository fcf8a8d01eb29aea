"""SamplingParams: the per-request decoding knobs, as accepted from an API request."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

_MAX_SEED = 2**63 - 1
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _is_int(x: object) -> bool:
    """True for a real int (bool excluded, since JSON `true` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """True for an int or float (bool excluded); NaN fails the range checks that follow."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Decoding settings for one request.

    `top_k == -1` turns top-k off; `temperature == 0` (or `top_k == 1`) means greedy decoding.
    `seed` of None lets the server draw one. `stop` accepts a single string, wrapped into a list.
    `min_tokens`: EOS and `stop_token_ids` are masked until that many tokens are out.
    Penalties follow OpenAI (presence / frequency, over the output tokens, in [-2, 2]) and
    vLLM (repetition: logits of tokens seen in the prompt or output divided by it when positive,
    multiplied when negative). `logit_bias` adds its value (in [-100, 100]) to a token's logit.
    `allowed_token_ids` (vLLM): only these ids can be sampled (None: any); `banned_token_ids`:
    these ids are never sampled (vLLM's single-token `bad_words`, once tokenized).
    `json_schema` / `regex` / `ebnf` / `structural_tag` (xgrammar's JSON form): the output follows
    that grammar. `skip_special_tokens` / `spaces_between_special_tokens`: how output is decoded.
    Construction does not validate; call `validate()` (or build through `from_dict`).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    banned_token_ids: list[int] = field(default_factory=list)
    # structured output: at most one of these constrains the output (a grammar engine's input)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise the list fields; anything else is left for validate() to reject.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax: temperature 0 or top_k 1."""
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError (one line naming the field and its allowed range) on a bad value."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"
            )
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}"
            )
        if not isinstance(self.logit_bias, dict) or not all(
            _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100
            for k, v in self.logit_bias.items()
        ):
            raise ValueError(
                "logit_bias must map token ids (ints >= 0) to numbers in [-100, 100], "
                f"got {self.logit_bias!r}"
            )
        if self.allowed_token_ids is not None and not (
            isinstance(self.allowed_token_ids, list)
            and self.allowed_token_ids
            and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(
                "allowed_token_ids must be None or a non-empty list of ints >= 0, "
                f"got {self.allowed_token_ids!r}"
            )
        if not isinstance(self.banned_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.banned_token_ids
        ):
            raise ValueError(
                f"banned_token_ids must be a list of ints >= 0, got {self.banned_token_ids!r}"
            )
        constraints = [n for n in CONSTRAINT_FIELDS if getattr(self, n) is not None]
        for name in constraints:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if len(constraints) > 1:
            raise ValueError(
                f"{constraints[1]} cannot be combined with {constraints[0]}: give at most one "
                "structured-output constraint"
            )

    @property
    def has_penalties(self) -> bool:
        """True when a penalty changes the logits (all at their neutral values: False)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits change before sampling at every step: penalties, logit_bias,
        allowed or banned token ids (min_tokens, which lapses, is the caller's to check)."""
        return bool(
            self.has_penalties
            or self.logit_bias
            or self.banned_token_ids
            or self.allowed_token_ids is not None
        )

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field name, grammar text) of the structured-output constraint, None without one."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build and validate from a request dict; unknown keys raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(d.get("logit_bias"), dict):  # JSON object keys are strings
            d = {**d, "logit_bias": _int_keys(d["logit_bias"])}
        params = cls(**d)
        params.validate()
        return params


def _int_keys(bias: dict[object, object]) -> dict[object, object]:
    """`{"42": 5}` (a JSON object) -> `{42: 5}`; a key that is no integer is left to validate()."""
    out: dict[object, object] = {}
    for key, value in bias.items():
        out[int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key] = value
    return out
