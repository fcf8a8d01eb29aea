"""Pydantic models of the HTTP API: OpenAI `/v1/completions` and `/v1/chat/completions`
(requests, responses, stream chunks, usage, logprobs), the native `/generate` request and the
OpenAI-style error body.

Requests are validated strictly (JSON `"5"` is not an int, `true` is not a number) and unknown
fields are rejected, so a typo is a 400 naming the field instead of a silently ignored option.
Range checks live here too, so an error names the API's field (`max_tokens`), not the engine's.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from replaylm.runtime.io_struct import MAX_TOP_LOGPROBS
from replaylm.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

PositiveInt = Annotated[int, Field(ge=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat. `None` (or omitted) means the default."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as an end-user id for abuse tracking

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("top_k must be -1 (off) or an int >= 1")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported: send several requests for several choices")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; omitted fields take OpenAI's defaults."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_SamplingRequest):
    """`prompt`: a string or a list of token ids (a one-element list of either is unwrapped).
    `logprobs`: k = return the sampled token's logprob and the k most likely alternatives."""

    prompt: Any
    max_tokens: PositiveInt | None = None
    logprobs: TopLogprobs | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        is_ids = isinstance(v, list) and all(type(t) is int for t in v)
        if not isinstance(v, str) and not is_ids:
            if isinstance(v, list) and all(isinstance(p, (str, list)) for p in v):
                raise ValueError(
                    "several prompts in one request are not supported: send one request per prompt"
                )
            raise ValueError("prompt must be a string or a list of token ids")
        if not v:
            raise ValueError("the prompt is empty")
        return v


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (text parts joined into one string)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingRequest):
    """`max_completion_tokens` (newer name) wins over `max_tokens`; neither = up to the context.
    `top_logprobs` needs `logprobs: true`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class NativeGenerateRequest(_Request):
    """`POST /generate`: exactly one of `text` / `input_ids`; `sampling_params` holds
    SamplingParams fields (`max_new_tokens`, `temperature`, ...)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0


# ---- responses ------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (with `usage` None until the optional last one) a stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "replaylm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    NativeGenerateRequest,
    ChatMessage,
    TextPart,
    StreamOptions,
)
