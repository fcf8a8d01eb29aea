"""Pydantic models of `POST /v1/responses` requests (OpenAI's Responses API), and their
translation into the chat request that serves them (`ChatCompletionRequest`).

`input` is a string (one user message) or a list of items: messages (roles user, system,
developer, assistant; text content or `input_text` / `output_text` parts), the model's
`function_call`s and the caller's `function_call_output`s. `instructions` becomes a system
message ahead of everything. Function tools only; `text.format` is `text`, `json_object` or
`json_schema`. What would need hosted features (built-in tools, reasoning, background runs,
`include`, stored prompts and conversations, truncation) is refused naming the field; fields
with no effect here (`metadata`, `user`, `service_tier`, ...) are accepted. The conventions are
`openai_protocol`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from replaylm.entrypoints.openai_chat_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from replaylm.entrypoints.openai_protocol import (
    JsonObject,
    JsonSchemaFormat,
    PositiveInt,
    RequestModel,
    ResponseFormat,
)
from replaylm.runtime.errors import RequestError

_PART_TYPES = ("input_text", "output_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output")
# fields refused when they ask for something (OpenAI's hosted service has what they need)
_HOSTED = {
    "background": "background runs are not available",
    "include": "no included outputs are available (they need hosted features)",
    "top_logprobs": "output logprobs are not available on this route",
    "prompt": "stored prompts are not available",
    "conversation": "conversations are not available: use previous_response_id",
}


class InputPart(RequestModel):
    """A part of an input message's content (or of a function call's output): text only."""

    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in _PART_TYPES:
            raise ValueError(
                f"content parts of type {v!r} are not supported: this model reads text "
                "(input_text, output_text)"
            )
        return v


def _text(content: str | list[InputPart] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content or ""


class InputItem(RequestModel):
    """One item of `input`: a message (`type` "message", which may be left out), a
    `function_call` the model made, or a `function_call_output` answering one (`call_id`)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in _ITEM_TYPES:
            raise ValueError(
                f"input items of type {v!r} are not supported: replaylm takes "
                + ", ".join(_ITEM_TYPES)
            )
        return v

    def _require(self, index: int, *names: str) -> None:
        for name in names:
            if getattr(self, name) is None:
                raise RequestError(
                    f"an input item of type {self.type} needs `{name}`", f"input[{index}].{name}"
                )

    def chat_message(self, index: int) -> ChatMessage:
        """The item as the chat template takes it; RequestError naming a missing field."""
        if self.type == "function_call":
            self._require(index, "call_id", "name", "arguments")
            call = FunctionCall(name=self.name or "", arguments=self.arguments or "")
            return ChatMessage(
                role="assistant", tool_calls=[ToolCall(id=self.call_id, function=call)]
            )
        if self.type == "function_call_output":
            self._require(index, "call_id", "output")
            return ChatMessage(role="tool", tool_call_id=self.call_id, content=_text(self.output))
        self._require(index, "role", "content")
        return ChatMessage(role=self.role or "user", content=_text(self.content))


class FunctionTool(RequestModel):
    """A Responses-style tool: `{"type": "function", "name", "description", "parameters"}`."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None

    def chat_tool(self, index: int) -> Tool:
        if self.type != "function":
            raise RequestError(
                f"tools of type {self.type!r} are not available: replaylm runs no built-in "
                "tools (declare function tools)",
                f"tools[{index}].type",
            )
        if self.name is None:
            raise RequestError("a function tool needs its `name`", f"tools[{index}].name")
        function = FunctionDefinition(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )
        return Tool(function=function)


class ToolChoiceFunction(RequestModel):
    type: str
    name: str | None = None

    def chat_choice(self) -> NamedToolChoice:
        if self.type != "function" or self.name is None:
            raise RequestError(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "name": ...}',
                "tool_choice",
            )
        return NamedToolChoice(function=NamedFunction(name=self.name))


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None

    def chat_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        schema = JsonSchemaFormat(
            name=self.name, description=self.description, schema=self.schema_, strict=self.strict
        )
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint for reasoning models: nothing to do here


class Reasoning(RequestModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    """`POST /v1/responses`. `store` (default true) keeps the response for GET and for a later
    request's `previous_response_id`, whose input and output then open this one's conversation
    (its `instructions` do not carry over)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: JsonObject | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # refused when they ask for something (`check`)
    reasoning: Reasoning | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    prompt: JsonObject | None = None
    conversation: str | JsonObject | None = None

    def check(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise RequestError("input cannot be empty", "input")
        if self.reasoning is not None:
            for name in ("effort", "summary", "generate_summary"):
                if getattr(self.reasoning, name) is not None:
                    raise RequestError(
                        "reasoning is not available: this model does not reason",
                        f"reasoning.{name}",
                    )
        for name, why in _HOSTED.items():
            if getattr(self, name) not in (None, False, 0, []):
                raise RequestError(f"{name}: {why}", name)
        if self.truncation == "auto":
            raise RequestError(
                'truncation "auto" is not available: replaylm does not drop input', "truncation"
            )

    @property
    def should_store(self) -> bool:
        return self.store is not False

    def input_messages(self) -> list[ChatMessage]:
        """This request's input as chat messages (not its instructions)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return [item.chat_message(i) for i, item in enumerate(self.input)]

    def chat_request(self, conversation: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request for `conversation`, the instructions ahead of it; checked."""
        system = [ChatMessage(role="system", content=self.instructions)]
        fmt = self.text.format if self.text is not None else None
        choice: Any = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            choice = choice.chat_choice()
        # validated from a dict: the constructor's signature would want every field spelt out
        body = ChatCompletionRequest.model_validate(
            {
                "model": self.model,
                "messages": (system if self.instructions is not None else []) + conversation,
                "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "response_format": fmt.chat_format() if fmt is not None else None,
                "tools": [tool.chat_tool(i) for i, tool in enumerate(self.tools or [])] or None,
                "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls,
            }
        )
        body.check()
        return body
