"""Response plumbing: JSON bodies, server-sent event streams that abort their request when the
client goes away, and awaiting work unless the client disconnects first."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from replaylm.entrypoints.http_errors import APIError, error_payload
from replaylm.runtime.errors import ServiceUnavailableError

T = TypeVar("T")
# an event of a stream: a model or dict dumped as JSON, JSON text, or (unnamed streams) the bytes of
# an event already rendered (`sse_event`)
Payload = BaseModel | dict[str, Any] | str | bytes


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


class EventStream(StreamingResponse):
    """Server-sent events (`data: <json>`, then `data: [DONE]`) from `payloads`; `named` (the
    Responses API's form): each event opens with `event: <its type>`, and no `[DONE]` follows.
    The body generator is closed however the stream ends, so a client that disconnects aborts
    the request at once (not when the generator is garbage-collected); a scheduler failure
    mid-stream is sent as an error event (the status line is already out)."""

    media_type = "text/event-stream"

    def __init__(self, payloads: AsyncGenerator[Payload, None], named: bool = False) -> None:
        self._payloads, self._named = payloads, named
        super().__init__(())  # no body iterator: stream_response reads the payloads

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._payloads.aclose()

    async def stream_response(self, send: Any) -> None:
        """StreamingResponse's, framing each payload as its event in the same loop (a generator
        between them would cost every streamed token a hop)."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for payload in self._payloads:
                await send(_more(payload if isinstance(payload, bytes) else self._event(payload)))
        except ServiceUnavailableError as err:
            head = "event: error\n" if self._named else ""
            error = error_payload(503, str(err)).model_dump_json()
            await send(_more(f"{head}data: {error}\n\n".encode()))
        if not self._named:
            await send(_more(b"data: [DONE]\n\n"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _event(self, payload: BaseModel | dict[str, Any] | str) -> bytes:
        head = _event_line(payload) if self._named else ""
        return f"{head}data: {_dump(payload)}\n\n".encode()


def _more(event: bytes) -> dict[str, Any]:
    """The ASGI message sending `event`, more to come."""
    return {"type": "http.response.body", "body": event, "more_body": True}


def sse_event(data: str) -> bytes:
    """One unnamed server-sent event carrying `data` (JSON), as EventStream frames it."""
    return f"data: {data}\n\n".encode()


def _event_line(payload: BaseModel | dict[str, Any] | str) -> str:
    if isinstance(payload, str):
        return f"event: {json.loads(payload)['type']}\n"
    fields = payload if isinstance(payload, dict) else vars(payload)  # a model's own fields
    return f"event: {fields['type']}\n"


def _dump(payload: BaseModel | dict[str, Any] | str) -> str:
    """`payload` as JSON (a str: already JSON)."""
    if isinstance(payload, str):
        return payload
    if isinstance(payload, BaseModel):
        return payload.model_dump_json()
    return json.dumps(payload, ensure_ascii=False)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (cancelling a generation aborts
    the request, which frees its KV at once) and raise APIError(499)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise APIError(499, "the client disconnected before the response was ready")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (once the body is read, `receive` has nothing else)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
