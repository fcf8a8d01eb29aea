"""Pydantic models of chat requests: messages (with tool calls and tool results), tools and
`tool_choice`, the chat template's options, `POST /v1/chat/completions` and vLLM's
`POST /tokenize`. The conventions are `openai_protocol`'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from replaylm.entrypoints.openai_protocol import (
    JsonObject,
    PositiveInt,
    RequestModel,
    SamplingRequest,
    TopLogprobs,
)
from replaylm.runtime.errors import RequestError


class ContentPart(RequestModel):
    """A part of a message's content; only text (and an assistant's refusal) is taken."""

    type: str
    text: str | None = None
    refusal: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in ("text", "refusal"):
            raise ValueError(
                f"content parts of type {v!r} are not supported: this model reads text"
            )
        return v

    @property
    def as_text(self) -> str:
        return (self.text if self.type == "text" else self.refusal) or ""


class FunctionCall(RequestModel):
    name: str
    arguments: str = ""  # JSON text, as OpenAI sends it


class ToolCall(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        """As the tool-call module takes it (`tool_prompt` writes it for the template)."""
        call = {"name": self.function.name, "arguments": self.function.arguments}
        return {"id": self.id, "type": "function", "function": call}


OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class ChatMessage(RequestModel):
    """A message; an assistant's may carry `tool_calls` (its content then may be null), a
    `tool` message answers the call named by `tool_call_id`. Content is required (OpenAI's
    rule) but of an assistant's message that calls or refuses, and of the deprecated `function`
    role's. Roles beyond OPENAI_ROLES go to the chat template as they are (vLLM's rule)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # deprecated form of one tool call
    refusal: str | None = None

    @property
    def lacks_content(self) -> bool:
        """No content where OpenAI requires some."""
        if self.content is not None or self.role == "function":
            return False
        says = self.tool_calls or self.function_call is not None or self.refusal is not None
        return not (self.role == "assistant" and says)

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.as_text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(ToolCall(function=self.function_call))
        if calls:
            out["tool_calls"] = [call.template_dict() for call in calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateOptions(RequestModel):
    """How messages are rendered (vLLM / SGLang): `add_generation_prompt` (default: unless
    `continue_final_message`, which leaves the last message open for the model to continue),
    `add_special_tokens` (the tokenizer's BOS and the like on top of the template's),
    `chat_template_kwargs` (further template variables), `documents` (for templates that cite
    them, as transformers passes them), `tools` (offered to the model in its
    tool-call format: `tool_calls.ChatTools`). vLLM's `chat_template` (a template of the
    request's own) is refused: the tokenizer renders its own template only."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: JsonObject | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[Tool] | None = None

    def _check_messages(self, messages: list[ChatMessage]) -> None:
        if self.chat_template is not None:
            raise RequestError(
                "chat_template is not supported: messages are rendered with the model's own "
                "chat template",
                "chat_template",
            )
        for i, message in enumerate(messages):
            if message.lacks_content:
                raise RequestError(
                    "Invalid value for 'content': expected a string, got null.",
                    f"messages[{i}].content",
                )
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        if self.continue_final_message and messages[-1].role != "assistant":
            raise RequestError(
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
            )

    def template_options(self) -> dict[str, Any]:
        """chat_input_ids' keyword options for this request, `tools` aside (`chat_prompt`)."""
        cont = bool(self.continue_final_message)
        return {
            "add_generation_prompt": not cont
            if self.add_generation_prompt is None
            else self.add_generation_prompt,
            "continue_final_message": cont,
            "add_special_tokens": bool(self.add_special_tokens),
            "template_kwargs": {
                **(self.chat_template_kwargs or {}),
                **({"documents": self.documents} if self.documents is not None else {}),
            }
            or None,
        }


class ChatCompletionRequest(ChatTemplateOptions, SamplingRequest):
    """`max_completion_tokens` (newer name) wins over `max_tokens`; neither = up to the context.
    `top_logprobs` > 0 needs `logprobs: true`. `echo` (vLLM): a reply that continues the last
    message (the assistant's) starts with that message's text. Tools: `tool_choice` defaults to
    `auto` with tools and `none` without; the deprecated `functions` / `function_call` likewise.
    Refused when asked for: audio output (`modalities`, `audio`), `store: true`, web search."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    echo: bool | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: JsonObject | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: JsonObject | None = None  # a hint for faster decoding: the output is the same
    reasoning_effort: str | None = None  # hints for reasoning models: nothing to do here
    verbosity: str | None = None
    web_search_options: JsonObject | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output budget asked for and the field that asked for it."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def top_logprobs_k(self) -> int | None:
        """How many alternatives each output token's logprobs carry; None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        self._check_messages(self.messages)
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs: true", "top_logprobs")
        if self.modalities and "audio" in self.modalities:
            raise RequestError(
                "audio output is not available: this model writes text", "modalities"
            )
        if self.audio is not None:
            raise RequestError("audio output is not available: this model writes text", "audio")
        if self.store:
            raise RequestError("store: true is not available: replaylm keeps no outputs", "store")
        if self.web_search_options is not None:
            raise RequestError("web search is not available", "web_search_options")
        if isinstance(self.function_call, NamedFunction):
            names = [function.name for function in self.functions or []]
            if self.function_call.name not in names:
                raise RequestError(
                    f"function_call names {self.function_call.name!r}, which is not among the "
                    "declared functions",
                    "function_call",
                )


class TokenizeRequest(ChatTemplateOptions):
    """`POST /tokenize` (vLLM): `prompt` (a string; `add_special_tokens` defaults to true), or
    `messages` rendered as the chat route renders them (same options) -> `{"count",
    "max_model_len", "tokens"}`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    return_token_strs: bool | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("send exactly one of `prompt` and `messages`", "prompt")
        if self.messages is not None:
            self._check_messages(self.messages)
