"""`POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/{id}`.

A request becomes a chat request (`responses_protocol`) and runs through the chat route's
machinery (`serving_chat.start_chat`: template, tools, structured output, sampling); its output
text is parsed for tool calls as chat parses it and built into output items
(`responses_events`), whole or streamed as named server-sent events. Stored responses
(`responses_store`) carry their conversation, which `previous_response_id` continues.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response

from replaylm.entrypoints.choices import ChoiceOutput, UsageCounter, collect, finish_reason
from replaylm.entrypoints.http_errors import APIError
from replaylm.entrypoints.http_parsing import parse_body
from replaylm.entrypoints.http_streaming import EventStream, json_response, unless_disconnected
from replaylm.entrypoints.openai_chat_protocol import ChatMessage
from replaylm.entrypoints.openai_responses import UsageInfo
from replaylm.entrypoints.responses_events import Event, OutputBuilder
from replaylm.entrypoints.responses_output import (
    DeletedResponse,
    IncompleteDetails,
    ItemStatus,
    ResponseObject,
    ResponseUsage,
    new_id,
)
from replaylm.entrypoints.responses_protocol import ResponsesRequest, ToolChoiceFunction
from replaylm.entrypoints.responses_store import (
    ResponseStore,
    SharedResponseStore,
    StoredResponse,
)
from replaylm.entrypoints.serving_chat import StartedChat, start_chat
from replaylm.entrypoints.serving_common import ServingContext
from replaylm.entrypoints.tool_call_parser import Delta, ToolCallParser
from replaylm.runtime.errors import RequestError

# the chat request's fields, as errors about them name the Responses request's (most specific
# first; `messages` indices do not match `input`'s, so they are dropped)
_PARAMS = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
)


@contextlib.contextmanager
def _responses_params() -> Iterator[None]:
    """Report the chat machinery's errors under the Responses API's field names."""
    try:
        yield
    except RequestError as err:
        param, message = err.param, str(err)
        for chat, ours in _PARAMS:
            message = message.replace(chat, ours)
            if param is not None and param.startswith(chat):
                param = ours + param[len(chat) :]
        if param is not None and param.startswith("messages"):
            param = "input"
        raise RequestError(message, param, err.code) from err


class ResponsesRoute:
    def __init__(self, ctx: ServingContext, store: ResponseStore | SharedResponseStore) -> None:
        self.ctx = ctx
        self.store = store

    async def create(self, request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        self.ctx.check_model(body.model)
        conversation = self._history(body.previous_response_id)
        with _responses_params():
            conversation += body.input_messages()
            chat = await start_chat(self.ctx, request, body.chat_request(conversation))
        turn = _Turn(self.ctx, self.store, body, chat, conversation)
        if body.stream:
            return EventStream(turn.events(chat.stream), named=True)
        results, usage = await unless_disconnected(request, collect(chat.stream))
        return json_response(turn.whole(results[0].text, finish_reason(results[0].last), usage))

    async def retrieve(self, response_id: str) -> Response:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return json_response(stored.response)

    async def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return json_response(DeletedResponse(id=response_id))

    def _history(self, previous_response_id: str | None) -> list[ChatMessage]:
        """The conversation a request continues (a copy: this turn extends it)."""
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise APIError(
                400,
                f"Previous response with id '{previous_response_id}' not found.",
                "previous_response_id",
                "previous_response_not_found",
            )
        return list(stored.conversation)


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "response_id")


class _Turn:
    """One request's response: its output built from the generated text, then stored."""

    def __init__(
        self,
        ctx: ServingContext,
        store: ResponseStore | SharedResponseStore,
        body: ResponsesRequest,
        chat: StartedChat,
        conversation: list[ChatMessage],
    ) -> None:
        self.ctx, self.store, self.body, self.conversation = ctx, store, body, conversation
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.output = OutputBuilder()
        # calls are parsed out of the text where tools are offered (as the chat route does)
        tools = ctx.chat_tools
        self.parser: ToolCallParser | None = (
            tools.parser(chat.tools) if tools is not None and chat.tools is not None else None
        )

    def _pieces(self, text: str, final: bool) -> list[Delta]:
        if self.parser is None:
            return [{"content": text}]
        return self.parser.feed(text) + (self.parser.finish() if final else [])

    def _response(self, status: ItemStatus, usage: ResponseUsage | None) -> ResponseObject:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        choice = body.tool_choice or "auto"
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.ctx.model_name,
            output=self.output.items,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=body.should_store,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            text={
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },
            tool_choice=choice.model_dump(exclude_none=True)
            if isinstance(choice, ToolChoiceFunction)
            else choice,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            usage=usage,
            metadata=body.metadata or {},
            user=body.user,
        )

    def _finish(self, reason: str | None, usage: UsageInfo) -> tuple[list[Event], ResponseObject]:
        """The events closing the output, and the response (stored where asked)."""
        status: ItemStatus = "incomplete" if reason == "length" else "completed"
        events = self.output.close(status)
        response = self._response(status, ResponseUsage.of(usage))
        if self.body.should_store:
            conversation = [*self.conversation, self.output.chat_message()]
            self.store.put(StoredResponse(response, conversation))
        return events, response

    def whole(self, text: str, reason: str | None, usage: UsageInfo) -> ResponseObject:
        for piece in self._pieces(text, final=True):
            self.output.feed(piece)
        return self._finish(reason, usage)[1]

    async def events(self, stream: AsyncIterator[ChoiceOutput]) -> AsyncGenerator[Event, None]:
        opening = self._response("in_progress", None).model_dump()
        yield self.output.event("response.created", response=opening)
        yield self.output.event("response.in_progress", response=opening)
        usage = UsageCounter()
        reason = None
        async for c in stream:
            usage.add(c)
            reason = finish_reason(c.out)
            for piece in self._pieces(c.out.text, final=reason is not None):
                for event in self.output.feed(piece):
                    yield event
        closing, response = self._finish(reason, usage.total())
        for event in closing:
            yield event
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield self.output.event(kind, response=response.model_dump())
