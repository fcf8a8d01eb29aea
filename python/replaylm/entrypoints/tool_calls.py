"""Tool calls for the chat route: which format a model uses, the prompt, forced calls, parsing.

    tools = ChatTools(tokenizer)                # once per served model; logs the format chosen
    request = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    messages, offered = tools.prompt(messages, request)     # request None: no tools offered
    ids = chat_input_ids(tokenizer, messages, tools=offered)
    params.structural_tag = tools.structural_tag(request)   # "required" / a named function
    tools.parse(text, request) / tools.parser(request)      # -> content and tool_calls

The format comes from the chat template: one that writes `<tool_call>` blocks (Qwen2.5, Qwen3,
Hermes) or asks for `{"name": ..., "parameters": ...}` JSON (Llama 3.x) gets the tools and the
conversation's calls and results through the template itself. Any other template (SmolLM2's)
gets the fallback: a system message describing the tools and asking for JSON calls, with
earlier calls and results written into the conversation as plain text.

`tool_choice` "required" or a named function is enforced by a structural tag (xgrammar) that
allows only calls, each to a declared function with arguments that match its schema: nothing
before, between or after them but the format's separator, so even a small model cannot talk
past the call. "auto" is not constrained (as in vLLM): the model may answer in text.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replaylm.entrypoints.tool_call_parser import (
    TOOL_CALL_OPEN,
    ParsedOutput,
    ToolCallParser,
    ToolFormat,
)
from replaylm.entrypoints.tool_prompt import fallback_messages, template_messages
from replaylm.runtime.errors import RequestError

if TYPE_CHECKING:
    from replaylm.model_loader.tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
# Llama 3.x templates ask: Respond in the format {"name": function name, "parameters": ...}
_JSON_CALL_INSTRUCTION = re.compile(r'\{"name": [^{}"]*, "parameters":')


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, checked. `function`: the function `tool_choice` names, else None."""

    tools: list[dict[str, Any]]
    required: bool
    function: str | None
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The checked tool settings of a request; None when no tool is offered (no tools, or
    `tool_choice` "none"). Raises RequestError naming the field at fault."""
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    tools = tools or []
    names = [_tool_name(tool, i) for i, tool in enumerate(tools)]
    if len(set(names)) != len(names):
        raise RequestError("tools declares a function name twice", "tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise RequestError("parallel_tool_calls must be a bool", "parallel_tool_calls")
    function = None
    if isinstance(tool_choice, dict):
        function = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(function, str):
            raise RequestError(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if function not in names:
            raise RequestError(f"Tool '{function}' has not been passed in `tools`.", "tool_choice")
    elif tool_choice is not None and tool_choice not in _CHOICES:
        raise RequestError(
            f"tool_choice must be one of {', '.join(_CHOICES)} or a function", "tool_choice"
        )
    if tool_choice == "required" and not tools:
        raise RequestError('tool_choice "required" needs tools', "tool_choice")
    if not tools or tool_choice == "none":
        return None
    return ToolRequest(tools, tool_choice == "required", function, parallel_tool_calls is not False)


def _tool_name(tool: Any, i: int) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise RequestError(
            f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools"
        )
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(
            f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'", "tools"
        )
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    if parameters:
        _check_parameters(parameters, f"tools[{i}].function.parameters")
    return name


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    """RequestError naming `param` unless `schema` compiles: checked whatever `tool_choice`
    says, so a schema that could not force a call is refused before the model answers."""
    # imports xgrammar: structured output is imported where it is first needed
    from replaylm.structured.compiler import check_json_schema

    try:
        check_json_schema(json.dumps(schema))
    except ValueError as err:
        raise RequestError(f"{param} is not a valid JSON schema: {err}", param) from err


def detect_tool_format(chat_template: str | dict[str, str] | None) -> tuple[ToolFormat, str]:
    """The tool format of a chat template, and why (for the log)."""
    if isinstance(chat_template, dict):  # named templates: the tool one, where there is one
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not chat_template:
        return ToolFormat.FALLBACK, "the tokenizer has no chat template"
    if TOOL_CALL_OPEN in chat_template:
        return ToolFormat.TAGGED, "the chat template writes <tool_call> blocks"
    takes_tools = re.search(r"\btools\b", chat_template) is not None
    if takes_tools and _JSON_CALL_INSTRUCTION.search(chat_template):
        return ToolFormat.JSON, 'the chat template asks for {"name", "parameters"} JSON calls'
    if takes_tools:
        return (
            ToolFormat.FALLBACK,
            "the chat template's tool-call syntax is not one replaylm parses",
        )
    return ToolFormat.FALLBACK, "the chat template takes no tools"


class ChatTools:
    """Tool calls through one tokenizer's chat template."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.format, reason = detect_tool_format(getattr(tokenizer, "chat_template", None))
        how = (
            "the fallback prompt and JSON calls"
            if self.format is ToolFormat.FALLBACK
            else (f"the {self.format.value} format")
        )
        logger.info("tool calls use %s: %s", how, reason)

    def prompt(
        self, messages: list[dict[str, Any]], request: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The conversation and the tools to render through the chat template (chat_input_ids'
        `messages` and `tools`), with `request`'s tools offered to the model (None: none)."""
        tools = None if request is None else request.tools
        if self.format is ToolFormat.FALLBACK:
            return fallback_messages(messages, tools), None
        return template_messages(messages), tools

    def structural_tag(self, request: ToolRequest | None) -> str | None:
        """The constraint (xgrammar structural tag JSON) forcing calls; None where not forced."""
        if request is None or not (request.required or request.function):
            return None
        tags = {t["function"]["name"]: self._call_tag(t["function"]) for t in request.tools}
        fmt: dict[str, Any]
        if request.function is not None:
            fmt = tags[request.function]
        elif request.parallel:
            separator = "\n" if self.format is ToolFormat.TAGGED else "; "
            fmt = {
                "type": "tags_with_separator",
                "tags": list(tags.values()),
                "separator": separator,
                "at_least_one": True,
            }
        else:
            fmt = {"type": "or", "elements": list(tags.values())}
        return json.dumps({"type": "structural_tag", "format": fmt})

    def _call_tag(self, function: dict[str, Any]) -> dict[str, Any]:
        name = function["name"]
        schema = function.get("parameters") or {"type": "object"}
        content = {"type": "json_schema", "json_schema": schema}
        if self.format is ToolFormat.TAGGED:
            begin = f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": '
            return {"type": "tag", "begin": begin, "content": content, "end": "}\n</tool_call>"}
        begin = f'{{"name": "{name}", "parameters": '
        return {"type": "tag", "begin": begin, "content": content, "end": "}"}

    def parser(self, request: ToolRequest) -> ToolCallParser:
        """An incremental parser for one streamed choice."""
        return ToolCallParser(self.format, request.names, None if request.parallel else 1)

    def parse(self, text: str, request: ToolRequest) -> ParsedOutput:
        """A whole answer as content and tool calls."""
        return ToolCallParser.parse(
            text, self.format, request.names, None if request.parallel else 1
        )
