"""Pydantic models of the HTTP API's responses: completions and chat (whole and stream chunks),
usage, logprobs, tool calls, models, /tokenize and /detokenize, and the OpenAI-style error body."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class PromptLogprob(BaseModel):
    """vLLM's `prompt_logprobs` entry for one candidate token (keyed by its id)."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    """Legacy-format logprobs; the first prompt token's entries are null under `echo`."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# SGLang's `matched_stop`: the stop string or token id (EOS included) that ended a choice
MatchedStop = int | str | None


class CompletionChoice(BaseModel):
    """`prompt_token_ids` (in a stream: the choice's first chunk) and `token_ids` with vLLM's
    `return_token_ids`."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: MatchedStop = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class _ResponseHead(BaseModel):
    """The fields every completion, chat completion and chat chunk opens with, in OpenAI's
    order; a subclass narrows `object` to its literal (an overridden field keeps its place)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str


class CompletionResponse(_ResponseHead):
    """A whole completion, or (with `usage` None unless asked for) a stream chunk."""

    object: Literal["text_completion"] = "text_completion"
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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None  # "tool_calls" when the message calls tools
    matched_stop: MatchedStop = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    # vLLM: the prompt's, shared by the choices
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: `id`, `type` and `function.name` come first, then
    `function.arguments` in pieces, all under the call's `index`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: MatchedStop = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on each choice's first chunk


class ModelCard(BaseModel):
    """vLLM's and SGLang's card: `root` is the model's path, `parent` is for adapters (none)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "replaylm"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
