"""Pydantic models of the HTTP API's requests: OpenAI `/v1/completions` (the fields every
sampling request shares live in `SamplingRequest`), the native `/generate` and `/detokenize`.
Chat requests and `/tokenize` are in `openai_chat_protocol`.

Requests take what clients send as vLLM and SGLang take it. Every OpenAI field is modelled and
accepted at its default (`null` included); a field replaylm cannot honour is refused (400
naming it, from `check()`) only when it asks for something, such as a non-empty `suffix`.
Unknown fields are ignored (`ignored_fields()` names them for a log line), so every vendor field
that changes the output is modelled. Values keep strict types: JSON `"5"` is not an int, `true`
is not a number. Range checks live here, so an error names the API's field (`max_tokens`), not
the engine's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from replaylm.entrypoints.bad_words import Encode, bad_word_ids
from replaylm.entrypoints.openai_constraints import (
    JSON_OBJECT,
    Constraint,
    only_one,
    whitespace_refused,
)
from replaylm.runtime.errors import RequestError
from replaylm.runtime.io_struct import MAX_TOP_LOGPROBS
from replaylm.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

PositiveInt = Annotated[int, Field(ge=1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
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

    def constraint(self) -> Constraint | None:
        """The constraint this format asks for; None for `text`."""
        if self.type == "json_object":
            return Constraint("response_format", "json_schema", JSON_OBJECT)
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
            return Constraint.grammar(
                "response_format.json_schema.schema", "json_schema", self.json_schema.schema_
            )
        if self.type == "structural_tag":
            tag = self.model_dump(
                exclude_none=True, include={"type", "structures", "triggers", "format"}
            )
            return Constraint.structural_tag("response_format", tag)
        return None


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice`, `grammar`
    (EBNF), `json_object` or `structural_tag` (JSON text), and options. Every key changes the
    output, so an unknown one is refused rather than ignored. Schemas compile strictly, which is
    what `disable_additional_properties` asks; there is no other backend, so nothing to
    `disable_fallback` to; JSON whitespace is free in the engine's grammars, so
    `disable_any_whitespace` and `whitespace_pattern`, which would shape it, are refused."""

    model_config = ConfigDict(extra="forbid")

    json_: str | JsonObject | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None

    def constraints(self) -> list[Constraint]:
        """The constraints asked for (more than one is the caller's error to report)."""
        for name in ("disable_any_whitespace", "whitespace_pattern"):
            if getattr(self, name) not in (None, False):
                raise whitespace_refused(f"structured_outputs.{name}")
        given: list[Constraint] = []
        if self.json_ is not None:
            given.append(Constraint.grammar("structured_outputs.json", "json_schema", self.json_))
        if self.regex is not None:
            given.append(Constraint("structured_outputs.regex", "regex", self.regex))
        if self.choice is not None:
            given.append(Constraint.choice("structured_outputs.choice", self.choice))
        if self.grammar is not None:
            given.append(Constraint("structured_outputs.grammar", "ebnf", self.grammar))
        if self.json_object:
            given.append(Constraint("structured_outputs.json_object", "json_schema", JSON_OBJECT))
        if self.structural_tag is not None:
            given.append(
                Constraint.structural_tag("structured_outputs.structural_tag", self.structural_tag)
            )
        return given


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _is_ids(value: Any) -> bool:
    """True for a list of token ids (bools excluded: JSON `true` is no token)."""
    return isinstance(value, list) and all(type(t) is int for t in value)


# the request fields that each hold one grammar, and the SamplingParams field each one sets
_GRAMMAR_FIELDS = {
    "json_schema": "json_schema",
    "guided_json": "json_schema",
    "regex": "regex",
    "guided_regex": "regex",
    "ebnf": "ebnf",
    "grammar": "ebnf",
    "guided_grammar": "ebnf",
}


class SamplingRequest(RequestModel):
    """The fields completions and chat share. `None` (or omitted) means the default.

    OpenAI's sampling fields, then the vendor fields of SGLang and vLLM (`top_k`, `min_p`, ...).
    Structured output, one constraint at most: `response_format`, SGLang's `json_schema`,
    `regex` or `ebnf` (`grammar`), vLLM's `structured_outputs` or its older `guided_json`,
    `guided_regex`, `guided_grammar`, `guided_choice` or `structural_tag`
    (`guided_decoding_backend` picks an engine, not an output: it is taken and left alone;
    `guided_whitespace_pattern` is refused). vLLM's output options: `include_stop_str_in_output`,
    `truncate_prompt_tokens` (`truncated_prompt()`), `return_token_ids`,
    `return_tokens_as_token_ids` (logprobs' tokens as `token_id:{id}`), `request_id` (the
    response's id is made from it); its sampling options `allowed_token_ids` (empty: any token)
    and `bad_words` (single-token words). Its `use_beam_search`, `priority`,
    `logits_processors`, `vllm_xargs`, `cache_salt` and `kv_transfer_params` are refused when
    they ask for something. `seed` takes any int64, as OpenAI's
    and vLLM's do; the engine's seeds are non-negative, so a negative one is taken modulo 2**63
    (-5 samples as 2**63 - 5 does, not as 5), which keeps it reproducible.
    """

    model: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: PositiveInt | None = None  # the tokenizer manager bounds it
    seed: Int64 | None = None
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
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None  # vLLM: keep the last N (-1: the context's worth)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: str | list[str] | None = None
    use_beam_search: bool | None = None  # refused when true (`_check_unsupported`)
    length_penalty: float | None = None  # beam search's: vLLM leaves it alone without beams too
    request_id: str | None = None  # the response's id is made from it
    # refused when they ask for something (`_check_unsupported`)
    priority: int | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: JsonObject | None = None
    cache_salt: str | None = None
    kv_transfer_params: JsonObject | None = None
    # structured output: one constraint at most (`constraint()`)
    json_schema: str | JsonObject | None = None
    regex: str | None = None
    ebnf: str | None = None
    grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | JsonObject | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 or 0 (off) or an int >= 1")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v is not None and v < 1 and v != -1:
            raise ValueError("truncate_prompt_tokens must be -1 (the context length) or >= 1")
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

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    def check(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError(
                "prompt_logprobs are not available with stream: true", "prompt_logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
            )
        if "" in self.stop_strings:  # it would match at once, everywhere
            raise RequestError("stop cannot contain an empty string.", "stop")
        self._check_unsupported()
        self.constraint()

    def _check_unsupported(self) -> None:
        """vLLM's fields that change the output, or what the server does, but that the engine
        cannot honour."""
        if self.use_beam_search:
            raise RequestError("beam search is not implemented", "use_beam_search")
        if self.priority:
            raise RequestError(
                f"Got priority {self.priority} but Priority scheduling is not enabled.", "priority"
            )
        refused = {
            "logits_processors": "this server runs no custom logits processors",
            "vllm_xargs": "this server runs no custom logits processors to take them",
            "cache_salt": "every request shares this server's prefix cache",
            "kv_transfer_params": "this server does not transfer KV caches between instances",
        }
        for field, why in refused.items():
            if getattr(self, field):
                raise RequestError(f"{field} is not supported: {why}", field)

    def truncated_prompt(self, ids: list[int], context_len: int) -> list[int]:
        """`ids` less all but their last `truncate_prompt_tokens`; RequestError naming it when it
        exceeds the context."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > context_len:
            raise RequestError(
                f"truncate_prompt_tokens ({keep}) is greater than the context length "
                f"({context_len})",
                "truncate_prompt_tokens",
            )
        return ids[-(context_len if keep == -1 else keep) :]

    def constraint(self) -> Constraint | None:
        """The structured-output constraint asked for; RequestError when more than one is, or
        one that cannot be honoured."""
        if self.guided_whitespace_pattern is not None:
            raise whitespace_refused("guided_whitespace_pattern")
        given: list[Constraint] = []
        if self.response_format is not None and (fmt := self.response_format.constraint()):
            given.append(fmt)
        for name, kind in _GRAMMAR_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                given.append(Constraint.grammar(name, kind, value))
        if self.guided_choice is not None:
            given.append(Constraint.choice("guided_choice", self.guided_choice))
        if self.structural_tag is not None:
            given.append(Constraint.structural_tag("structural_tag", self.structural_tag))
        if self.structured_outputs is not None:
            given += self.structured_outputs.constraints()
        return only_one(given)

    def sampling_params(
        self, max_new_tokens: int, max_tokens_param: str, encode: Encode
    ) -> SamplingParams:
        """The engine's SamplingParams, validated; omitted fields take OpenAI's defaults.
        `max_tokens_param` names the field a bad `max_new_tokens` is reported under; `encode`
        tokenizes `bad_words`."""
        constraint = self.constraint()
        bad_words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words or []
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=_or(self.min_p, 0.0),
            seed=None if self.seed is None else self.seed % 2**63,
            stop=self.stop_strings,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=_or(self.ignore_eos, False),
            min_tokens=_or(self.min_tokens, 0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            allowed_token_ids=self.allowed_token_ids or None,
            banned_token_ids=bad_word_ids(bad_words, encode),
            skip_special_tokens=_or(self.skip_special_tokens, True),
            spaces_between_special_tokens=_or(self.spaces_between_special_tokens, True),
            **({constraint.kind: constraint.text} if constraint else {}),
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
            raise ValueError("The prompt cannot be empty")
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
    # SGLang's: with return_logprob, k >= 0 adds the prompt's logprobs from token k on; -1 none
    logprob_start_len: int | None = None

    def check(self) -> None:
        if self.logprob_start_len is not None and self.logprob_start_len < -1:
            raise RequestError(
                f"logprob_start_len must be -1 or >= 0, got {self.logprob_start_len}",
                "logprob_start_len",
            )


class DetokenizeRequest(RequestModel):
    """`POST /detokenize` (vLLM): `{"tokens": [...]}` -> `{"prompt": text}`."""

    model: str | None = None
    tokens: list[TokenId]
