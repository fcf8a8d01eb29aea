"""Tool calls in the prompt: the conversation's calls and results (and, for templates without
tool support, the tools themselves) written the way a chat template can take them."""

from __future__ import annotations

import json
from typing import Any

FALLBACK_PROMPT = (
    "You can call these functions:\n{functions}\n\n"
    'To call a function, answer with only a JSON object: {{"name": <function name>, '
    '"parameters": <its arguments as a JSON object>}}. To call several, separate the objects '
    'with "; ". When no function is needed, answer in plain text.'
)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as tool-aware templates take them: call arguments as objects (templates write
    them with `tojson`), and each tool result named after its call (some templates need it)."""
    names: dict[str, str] = {}
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [_call_with_object_arguments(call) for call in message["tool_calls"]]
            names.update({call.get("id", ""): call["function"]["name"] for call in calls})
            message = {**message, "tool_calls": calls}
        elif message.get("role") == "tool" and "name" not in message:
            name = names.get(message.get("tool_call_id", ""))
            message = {**message, "name": name} if name is not None else message
        out.append(message)
    return out


def _call_with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` for a template without tool support: the `tools` offered (None: none) in a
    system message, earlier calls as the JSON the model is asked to write, tool results as user
    messages."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user message holding this round's results
    for message in messages:
        if message.get("role") == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id", ""), "a function")
            result = f"{name} returned: {message.get('content') or ''}"
            if results is None:
                results = {"role": "user", "content": result}
                out.append(results)
            else:
                results["content"] += "\n" + result
            continue
        results = None
        if message.get("tool_calls"):
            calls = message["tool_calls"]
            names.update({call.get("id", ""): call["function"]["name"] for call in calls})
            text = "; ".join(_fallback_call(call["function"]) for call in calls)
            content = message.get("content")
            message = {"role": "assistant", "content": f"{content}\n{text}" if content else text}
        out.append(message)
    if tools is None:
        return out
    functions = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    prompt = FALLBACK_PROMPT.format(functions=functions)
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


def _fallback_call(function: dict[str, Any]) -> str:
    arguments = function.get("arguments") or "{}"
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f'{{"name": "{function["name"]}", "parameters": {arguments}}}'
