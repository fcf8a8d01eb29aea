"""`POST /v1/chat/completions`: messages through the chat template, `n` choices, chat-format
logprobs, vLLM's `echo` and `prompt_logprobs`, tool calls (`tool_calls`); whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, overload

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from replaylm.entrypoints.choices import (
    C,
    ChoiceOutput,
    ChoiceResult,
    UsageCounter,
    collect,
    finish_reason,
    matched_stop,
    start_choices,
    with_stop_strings,
)
from replaylm.entrypoints.chunk_frames import ChunkFrames
from replaylm.entrypoints.http_parsing import parse_body, prompt_param
from replaylm.entrypoints.http_streaming import EventStream, json_response, unless_disconnected
from replaylm.entrypoints.logprob_format import chat_logprobs, prompt_logprobs
from replaylm.entrypoints.openai_chat_protocol import (
    OPENAI_ROLES,
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateOptions,
)
from replaylm.entrypoints.openai_constraints import Constraint, reported_under
from replaylm.entrypoints.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    ToolCallOut,
    UsageInfo,
)
from replaylm.entrypoints.serving_common import ServingContext, response_id
from replaylm.entrypoints.tool_call_parser import ToolCallParser
from replaylm.entrypoints.tool_calls import ToolRequest, tool_request
from replaylm.runtime.errors import RequestError
from replaylm.runtime.io_struct import GenerateRequest, TextFrame, TokenLogprob


def offered_tools(
    body: ChatTemplateOptions, tool_choice: Any = "auto", parallel: bool | None = None
) -> ToolRequest | None:
    """The tools a request offers the model, checked (None: none offered)."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump()
    return tool_request(tools, choice, parallel)


def chat_prompt(
    ctx: ServingContext,
    body: ChatTemplateOptions,
    messages: list[ChatMessage],
    tools: ToolRequest | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and chat_input_ids options of a chat request, its tools included in the
    model's tool-call format."""
    rendered = [m.template_dict() for m in messages]
    options = body.template_options()
    if ctx.chat_tools is not None:
        rendered, options["tools"] = ctx.chat_tools.prompt(rendered, tools)
    return rendered, options


@contextlib.contextmanager
def template_errors(messages: list[ChatMessage]) -> Iterator[None]:
    """A chat template failing on messages that include a role beyond OpenAI's: the error names
    the first such message's role, the likeliest cause (templates often refuse unknown roles)."""
    try:
        yield
    except RequestError as err:
        custom = next((i for i, m in enumerate(messages) if m.role not in OPENAI_ROLES), None)
        if err.param != "messages" or custom is None:
            raise
        role = messages[custom].role
        raise RequestError(
            f"{err} (messages[{custom}] has the role {role!r})", f"messages[{custom}].role"
        ) from err


def _forced_calls(
    ctx: ServingContext, tools: ToolRequest | None, asked: Constraint | None
) -> Constraint | None:
    """The constraint allowing only calls, where `tool_choice` forces them (None where it does
    not); RequestError where the request `asked` for another constraint as well."""
    tag = ctx.chat_tools.structural_tag(tools) if ctx.chat_tools is not None else None
    if tag is None:
        return None
    if asked is not None:
        raise RequestError(
            f"a forced tool_choice cannot be combined with {asked.param} "
            "(the call's arguments follow the function's schema)",
            "tool_choice",
        )
    return Constraint("tool_choice", "structural_tag", tag)


@dataclass
class StartedChat(Generic[C]):
    """A chat request under way: its choices' outputs as they come (and its text frames, where
    it was given a TextFrame), and what shows them."""

    stream: AsyncGenerator[C, None]
    rid: str
    prompt_ids: list[int]
    tools: ToolRequest | None


@overload
async def start_chat(
    ctx: ServingContext, request: Request, body: ChatCompletionRequest
) -> StartedChat[ChoiceOutput]: ...


@overload
async def start_chat(
    ctx: ServingContext,
    request: Request,
    body: ChatCompletionRequest,
    text_frame: TextFrame | None,
) -> StartedChat[ChoiceOutput | bytes]: ...


async def start_chat(
    ctx: ServingContext,
    request: Request,
    body: ChatCompletionRequest,
    text_frame: TextFrame | None = None,
) -> StartedChat[Any]:
    """Render, tokenize and start a checked chat request (the Responses API's too); bad input
    raises RequestError here, before any response has begun. `text_frame`: as
    `start_choices`'."""
    if body.functions and body.function_call != "none":
        raise RequestError(
            "the deprecated functions are not available: declare them as tools",
            "functions",
        )
    tools = offered_tools(body, body.effective_tool_choice, body.parallel_tool_calls)
    asked = body.constraint()
    forced = _forced_calls(ctx, tools, asked)
    messages, options = chat_prompt(ctx, body, body.messages, tools)
    with prompt_param("messages"), template_errors(body.messages):
        rendered = await run_in_threadpool(ctx.tm.encode_chat, messages, **options)
    ids = body.truncated_prompt(rendered, ctx.tm.context_len)
    requested, param = body.requested_max_tokens
    budget = ctx.output_budget(len(ids), requested, "messages", param)
    params = body.sampling_params(budget, param, ctx.tm.encode)
    if forced is not None:
        params.structural_tag = forced.text
    req = GenerateRequest(
        ids,
        params,
        top_logprobs=body.top_logprobs_k,
        prompt_logprobs=body.prompt_logprobs,
        n=body.num_choices,
    )
    with reported_under(forced or asked):
        stream = await start_choices(ctx.tm, request, [req], "messages", text_frame)
    if body.include_stop_str_in_output:
        stream = with_stop_strings(stream)
    return StartedChat(stream, req.rid, ids, tools)


class ChatRoute:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def handle(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        self.ctx.check_model(body.model)
        if not body.stream:
            chat = await start_chat(self.ctx, request, body)
            view = self._view(request, body, chat)
            results, usage = await unless_disconnected(request, collect(chat.stream))
            return json_response(view.response(results, usage))
        # a stream whose text-only chunks all look alike: rendered once the view exists
        plain = not (
            body.tools
            or body.continuous_usage
            or body.top_logprobs_k is not None
            or body.return_token_ids
        )
        text_frame = TextFrame() if plain else None
        framed = await start_chat(self.ctx, request, body, text_frame)
        view = self._view(request, body, framed)
        if text_frame is not None:
            text_frame.render = view.frames.event
        return EventStream(view.chunks(framed.stream), text_frame=text_frame)

    def _view(
        self, request: Request, body: ChatCompletionRequest, chat: StartedChat[Any]
    ) -> _ChatView:
        rid = response_id("chatcmpl", request, body.request_id, chat.rid)
        return _ChatView(self.ctx, body, rid, chat.prompt_ids, chat.tools)


class _ChatView:
    """One request's choices as the API shows them."""

    def __init__(
        self,
        ctx: ServingContext,
        body: ChatCompletionRequest,
        rid: str,
        prompt_ids: list[int],
        tools: ToolRequest | None,
    ) -> None:
        self.ctx, self.body, self.rid, self.prompt_ids = ctx, body, rid, prompt_ids
        self.created = int(time.time())  # every chunk of a stream shares it
        # vLLM's return_token_ids: the prompt's ids on the response, the output's on each choice
        self.token_ids = bool(body.return_token_ids)
        # calls are parsed out of the text where tools are offered
        self.tools = tools if ctx.chat_tools is not None else None
        last = body.messages[-1]
        # vLLM's echo: a reply continuing the assistant's last message starts with its text
        self.echo = last.text if body.echo and last.role == "assistant" else ""
        self.frames = ChunkFrames(self._chunk([]), _text_choice)

    def _logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs | None:
        k = self.body.top_logprobs_k
        as_ids = bool(self.body.return_tokens_as_token_ids)
        return None if k is None else chat_logprobs(lps, k, self.ctx.token_text, as_ids)

    def response(self, results: list[ChoiceResult], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=r.index,
                message=self._message(r.text),
                logprobs=self._logprobs(r.logprobs),
                finish_reason=finish_reason(r.last),
                matched_stop=matched_stop(r.last),
                token_ids=r.token_ids if self.token_ids else None,
            )
            for r in results
        ]
        for choice in choices:
            if choice.message.tool_calls and choice.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
        prompt_lps = None
        if self.body.prompt_logprobs is not None:
            lps = results[0].prompt_logprobs
            prompt_lps = prompt_logprobs(lps, self.body.prompt_logprobs, self.ctx.token_text)
        return ChatCompletionResponse(
            id=self.rid,
            model=self.ctx.model_name,
            system_fingerprint=self.ctx.fingerprint,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_lps,
            prompt_token_ids=self.prompt_ids if self.token_ids else None,
        )

    def _message(self, text: str) -> ChatMessageOut:
        if self.tools is None or self.ctx.chat_tools is None:
            return ChatMessageOut(content=self.echo + text)
        parsed = self.ctx.chat_tools.parse(text, self.tools)
        calls = [ToolCallOut.model_validate(call) for call in parsed.tool_calls]
        return ChatMessageOut(
            content=self.echo + (parsed.content or "") or None, tool_calls=calls or None
        )

    def _chunk(
        self,
        choices: list[ChatStreamChoice],
        usage: UsageInfo | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rid,
            created=self.created,
            model=self.ctx.model_name,
            system_fingerprint=self.ctx.fingerprint,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )

    async def chunks(
        self, stream: AsyncIterator[ChoiceOutput | bytes]
    ) -> AsyncGenerator[ChatCompletionChunk | str | bytes, None]:
        """The stream's chunks; one that only brings text comes from `ChunkFrames` (here, or as
        the `TextFrame` event already rendered)."""
        frames = self.frames
        # no output yet: its usage is the prompt's alone
        prompt_len = len(self.prompt_ids)
        start = UsageInfo(prompt_tokens=prompt_len, completion_tokens=0, total_tokens=prompt_len)
        prompt_ids = self.prompt_ids if self.token_ids else None
        for index in range(self.body.num_choices):
            opening = DeltaMessage(role="assistant", content=self.echo)
            choice = ChatStreamChoice(index=index, delta=opening)
            yield self._chunk([choice], start if self.body.continuous_usage else None, prompt_ids)
        usage = UsageCounter()
        plain = self.tools is None and not self.body.continuous_usage
        parsers: dict[int, ToolCallParser] = {}
        called: set[int] = set()  # choices that called a tool
        async for c in stream:
            if isinstance(c, bytes):
                yield c
                continue
            usage.add(c)
            logprobs = self._logprobs(c.out.logprobs or [])
            reason = finish_reason(c.out)
            deltas = [DeltaMessage(content=c.out.text)]
            if self.tools is not None and self.ctx.chat_tools is not None:
                parser = parsers.setdefault(c.index, self.ctx.chat_tools.parser(self.tools))
                pieces = parser.feed(c.out.text) + (parser.finish() if reason else [])
                deltas = [_delta(piece) for piece in pieces] or [DeltaMessage()]
                if any(delta.tool_calls for delta in deltas):
                    called.add(c.index)
                if reason == "stop" and c.index in called:
                    reason = "tool_calls"
            token_ids = c.out.token_ids if self.token_ids else None
            if plain and c.out.text and logprobs is None and reason is None and token_ids is None:
                yield frames.text(c.index, c.out.text)
                continue
            if c.out.text or (logprobs and logprobs.content) or reason or token_ids:
                last = len(deltas) - 1
                for i, delta in enumerate(deltas):  # logprobs and ids first, the finish last
                    choice = ChatStreamChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=logprobs if i == 0 else None,
                        finish_reason=reason if i == last else None,
                        matched_stop=matched_stop(c.out) if i == last else None,
                        token_ids=token_ids if i == 0 else None,
                    )
                    chunk_usage = usage.so_far(c) if self.body.continuous_usage else None
                    yield self._chunk([choice], chunk_usage)
        if self.body.include_usage:
            yield self._chunk([], usage.total())


def _text_choice(index: int, text: str) -> ChatStreamChoice:
    return ChatStreamChoice(index=index, delta=DeltaMessage(content=text))


def _delta(piece: dict[str, Any]) -> DeltaMessage:
    """A tool-call parser's delta as the API streams it."""
    calls = piece.get("tool_calls")
    return DeltaMessage(
        content=piece.get("content"),
        tool_calls=[DeltaToolCall.model_validate(call) for call in calls] if calls else None,
    )
