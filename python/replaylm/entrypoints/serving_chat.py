"""`POST /v1/chat/completions`: messages through the chat template, `n` choices, chat-format
logprobs, vLLM's `echo` and `prompt_logprobs`; whole or streamed. Tool calls join here, in
`hand_over_tools`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from replaylm.entrypoints.choices import (
    ChoiceOutput,
    ChoiceResult,
    UsageCounter,
    collect,
    finish_reason,
    start_choices,
)
from replaylm.entrypoints.http_parsing import parse_body, prompt_param
from replaylm.entrypoints.http_streaming import EventStream, json_response, unless_disconnected
from replaylm.entrypoints.logprob_format import chat_logprobs, prompt_logprobs
from replaylm.entrypoints.openai_chat_protocol import ChatCompletionRequest
from replaylm.entrypoints.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from replaylm.entrypoints.serving_common import ServingContext
from replaylm.runtime.errors import RequestError
from replaylm.runtime.io_struct import GenerateRequest, TokenLogprob


def hand_over_tools(body: ChatCompletionRequest) -> None:
    """Where the chat route hands a request's tools to the tool-call module (which will render
    them, constrain `required` and named choices, and parse calls out of the output). Until it
    is there, a request that asks for tool calls is refused; tools with `tool_choice: "none"`
    are only shown to the template."""
    if body.tools and body.effective_tool_choice != "none":
        raise RequestError(
            "tool calls are not available yet: send no tools, or tool_choice 'none'", "tools"
        )
    if body.functions and body.function_call != "none":
        raise RequestError(
            "function calls are not available yet: send no functions, or function_call 'none'",
            "functions",
        )


class ChatRoute:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def handle(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        self.ctx.check_model(body.model)
        hand_over_tools(body)
        messages = [m.template_dict() for m in body.messages]
        with prompt_param("messages"):
            ids = await run_in_threadpool(
                self.ctx.tm.encode_chat, messages, **body.template_options()
            )
        requested, param = body.requested_max_tokens
        req = GenerateRequest(
            ids,
            body.sampling_params(self.ctx.output_budget(len(ids), requested, param), param),
            top_logprobs=body.top_logprobs_k,
            prompt_logprobs=body.prompt_logprobs,
            n=body.num_choices,
        )
        stream = await start_choices(self.ctx.tm, request, [req], "messages")
        view = _ChatView(self.ctx, body, f"chatcmpl-{req.rid}", len(ids))
        if body.stream:
            return EventStream(view.chunks(stream))
        results, usage = await unless_disconnected(request, collect(stream))
        return json_response(view.response(results, usage))


class _ChatView:
    """One request's choices as the API shows them."""

    def __init__(
        self, ctx: ServingContext, body: ChatCompletionRequest, rid: str, prompt_len: int
    ) -> None:
        self.ctx, self.body, self.rid, self.prompt_len = ctx, body, rid, prompt_len
        last = body.messages[-1]
        # vLLM's echo: a reply continuing the assistant's last message starts with its text
        self.echo = last.text if body.echo and last.role == "assistant" else ""

    def _logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs | None:
        k = self.body.top_logprobs_k
        return None if k is None else chat_logprobs(lps, k, self.ctx.token_text)

    def response(self, results: list[ChoiceResult], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=r.index,
                message=ChatMessageOut(content=self.echo + r.text),
                logprobs=self._logprobs(r.logprobs),
                finish_reason=finish_reason(r.last),
            )
            for r in results
        ]
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
        )

    def _chunk(
        self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rid,
            model=self.ctx.model_name,
            system_fingerprint=self.ctx.fingerprint,
            choices=choices,
            usage=usage,
        )

    async def chunks(
        self, stream: AsyncIterator[ChoiceOutput]
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        # no output yet: its usage is the prompt's alone
        start = UsageInfo(
            prompt_tokens=self.prompt_len, completion_tokens=0, total_tokens=self.prompt_len
        )
        for index in range(self.body.num_choices):
            opening = DeltaMessage(role="assistant", content=self.echo)
            choice = ChatStreamChoice(index=index, delta=opening)
            yield self._chunk([choice], start if self.body.continuous_usage else None)
        usage = UsageCounter()
        async for c in stream:
            choice_usage = usage.add(c)
            logprobs = self._logprobs(c.out.logprobs or [])
            reason = finish_reason(c.out)
            if c.out.text or (logprobs and logprobs.content) or reason:
                choice = ChatStreamChoice(
                    index=c.index,
                    delta=DeltaMessage(content=c.out.text),
                    logprobs=logprobs,
                    finish_reason=reason,
                )
                yield self._chunk([choice], choice_usage if self.body.continuous_usage else None)
        if self.body.include_usage:
            yield self._chunk([], usage.total())
