"""Pydantic models of the HTTP API's requests: OpenAI `/v1/completions` (the fields every
sampling request shares live in `SamplingRequest`), the native `/generate` and `/detokenize`.
Chat requests and `/tokenize` are in `openai_chat_protocol`.

Requests take what clients send as vLLM and SGLang take it. Every OpenAI field is modelled and
accepted at its default (`null` included); a field replaylm cannot honour is refused (400
naming it, from `check()`) only when it asks for something, such as a non-empty `suffix`.
Unknown fields are ignored (`ignored_fields()` names them for a log line). Values keep strict
types: JSON `"5"` is not an int, `true` is not a number. Range checks live here, so an error
names the API's field (`max_tokens`), not the engine's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from replaylm.runtime.errors import RequestError
from replaylm.runtime.io_struct import MAX_TOP_LOGPROBS
from replaylm.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

PositiveInt = Annotated[int, Field(ge=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
JsonObject = dict[str, Any]


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The unknown fields sent (dotted paths, nested models included), which are ignored."""
        out = [f"{prefix}{name}" for name in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, RequestModel):
                out += value.ignored_fields(f"{prefix}{name}.")
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, RequestModel):
                        out += item.ignored_fields(f"{prefix}{name}[{i}].")
        return out

    def check(self) -> None:
        """Rules across fields, and what replaylm cannot honour: RequestError naming the field.
        Run after validation (a validator's ValueError could not carry the field's name)."""


class StreamOptions(RequestModel):
    """`continuous_usage_stats` (vLLM): every chunk carries the usage of its choice so far."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: JsonObject | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """`text` (no constraint), `json_object`, `json_schema` (`json_schema.schema`), or
    `structural_tag` (SGLang / vLLM: `structures` and `triggers`, or xgrammar's `format`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[JsonObject] | None = None
    triggers: list[str] | None = None
    format: JsonObject | None = None

    def constraint(self) -> tuple[str, str] | None:
        """(SamplingParams field, grammar text) this format asks for; None for `text`."""
        if self.type == "json_object":
            return "json_schema", json.dumps({"type": "object"})
        if self.type == "json_schema":
            if self.json_schema is None:
                raise RequestError(
                    "response_format of type json_schema needs `json_schema`",
                    "response_format.json_schema",
                )
            if self.json_schema.schema_ is None:
                raise RequestError(
                    "response_format.json_schema needs its `schema`",
                    "response_format.json_schema.schema",
                )
            return "json_schema", json.dumps(self.json_schema.schema_)
        if self.type == "structural_tag":
            body = self.model_dump(exclude_none=True, include={"type", "structures", "triggers"})
            return "structural_tag", json.dumps(self.format or body)
        return None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _is_ids(value: Any) -> bool:
    """True for a list of token ids (bools excluded: JSON `true` is no token)."""
    return isinstance(value, list) and all(type(t) is int for t in value)


def _choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (vLLM's `guided_choice`)."""
    special = set("\\^$.|?*+()[]{}/")
    escaped = ("".join(f"\\{c}" if c in special else c for c in choice) for choice in choices)
    return "(" + "|".join(escaped) + ")"


class SamplingRequest(RequestModel):
    """The fields completions and chat share. `None` (or omitted) means the default.

    OpenAI's sampling fields, then the vendor fields of SGLang and vLLM (`top_k`, `min_p`, ...);
    structured output: `response_format`, or one of `json_schema` (`guided_json`), `regex`
    (`guided_regex`), `ebnf` (`grammar`, `guided_grammar`), `guided_choice`.
    """

    model: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: PositiveInt | None = None  # the tokenizer manager bounds it
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    user: str | None = None  # an end-user id for abuse tracking: nothing to do with it
    response_format: ResponseFormat | None = None
    # vendor fields (SGLang / vLLM)
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: TopLogprobs | None = None
    json_schema: str | JsonObject | None = Field(
        None, validation_alias=AliasChoices("json_schema", "guided_json")
    )
    regex: str | None = Field(None, validation_alias=AliasChoices("regex", "guided_regex"))
    ebnf: str | None = Field(
        None, validation_alias=AliasChoices("ebnf", "grammar", "guided_grammar")
    )
    guided_choice: list[str] | None = Field(None, min_length=1)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 or 0 (off) or an int >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return v

    @property
    def num_choices(self) -> int:
        return _or(self.n, 1)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError(
                "prompt_logprobs are not available with stream: true", "prompt_logprobs"
            )
        self._constraint()

    def _constraint(self) -> tuple[str, str] | None:
        """The structured-output constraint asked for; RequestError when more than one is."""
        given: list[tuple[str, tuple[str, str]]] = []
        if self.response_format is not None:
            constraint = self.response_format.constraint()
            if constraint is not None:
                given.append(("response_format", constraint))
        if self.json_schema is not None:
            schema = self.json_schema
            text = schema if isinstance(schema, str) else json.dumps(schema)
            given.append(("json_schema", ("json_schema", text)))
        if self.regex is not None:
            given.append(("regex", ("regex", self.regex)))
        if self.ebnf is not None:
            given.append(("ebnf", ("ebnf", self.ebnf)))
        if self.guided_choice is not None:
            given.append(("guided_choice", ("regex", _choice_regex(self.guided_choice))))
        if len(given) > 1:
            raise RequestError(
                f"{given[1][0]} cannot be combined with {given[0][0]}: give at most one "
                "structured-output constraint",
                given[1][0],
            )
        return given[0][1] if given else None

    def sampling_params(self, max_new_tokens: int, max_tokens_param: str) -> SamplingParams:
        """The engine's SamplingParams, validated; omitted fields take OpenAI's defaults.
        `max_tokens_param` names the field a bad `max_new_tokens` is reported under."""
        constraint = self._constraint()
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=_or(self.min_p, 0.0),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=_or(self.ignore_eos, False),
            min_tokens=_or(self.min_tokens, 0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            skip_special_tokens=_or(self.skip_special_tokens, True),
            spaces_between_special_tokens=_or(self.spaces_between_special_tokens, True),
            **dict([constraint] if constraint else []),
        )
        try:
            params.validate()
        except ValueError as err:
            name = str(err).split(" ", 1)[0]
            param = max_tokens_param if name == "max_new_tokens" else name
            raise RequestError(str(err), param) from err
        return params


class CompletionRequest(SamplingRequest):
    """`prompt`: a string, a list of token ids, or a list of either (several prompts, each
    answered with `n` choices). `logprobs`: k = the sampled token's logprob and the k most
    likely alternatives. `echo`: the prompt's text (and, with `logprobs`, its tokens' logprobs)
    before the output; `max_tokens: 0` with `echo` returns the prompt alone. `best_of` may only
    equal `n` (no ranking of candidates); `suffix` must be empty (no insertion)."""

    prompt: Any
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None  # vLLM: BOS and the like, on by default

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> list[str | list[int]]:
        if isinstance(v, str) or _is_ids(v):
            prompts = [v]
        elif isinstance(v, list) and all(isinstance(p, str) or _is_ids(p) for p in v):
            prompts = v
        else:
            raise ValueError(
                "prompt must be a string, a list of token ids, or a list of strings or of "
                "token-id lists"
            )
        if not prompts or any(not p for p in prompts):
            raise ValueError("the prompt is empty")
        return prompts

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise RequestError("suffix is not supported: replaylm does not insert text", "suffix")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise RequestError(
                f"best_of must equal n ({self.num_choices}): replaylm returns every choice it "
                "generates and does not rank candidates",
                "best_of",
            )
        if self.max_tokens == 0 and not self.echo:
            raise RequestError(
                "max_tokens must be >= 1 (0 is allowed only with echo: true)", "max_tokens"
            )


class NativeGenerateRequest(RequestModel):
    """`POST /generate`: exactly one of `text` / `input_ids`; `sampling_params` holds
    SamplingParams fields (`max_new_tokens`, `temperature`, ...)."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0


class DetokenizeRequest(RequestModel):
    """`POST /detokenize` (vLLM): `{"tokens": [...]}` -> `{"prompt": text}`."""

    model: str | None = None
    tokens: list[TokenId]
