"""Response plumbing: JSON bodies, server-sent event streams that abort their request when the
client goes away, and awaiting work unless the client disconnects first."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Generator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from replaylm.entrypoints.http_errors import APIError, error_payload
from replaylm.runtime.errors import ServiceUnavailableError
from replaylm.runtime.io_struct import FrameSend, TextFrame

T = TypeVar("T")
SERVER_SEND = "replaylm.server_send"  # the scope key of the server's own send
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
    mid-stream is sent as an error event (the status line is already out). With `text_frame`
    (the one the payloads' request renders its frames with), the frames may also be written
    from outside the loop while the response is open (`TextFrame.send`), through the server's
    own send where the scope has it (`with_server_send`)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        payloads: AsyncGenerator[Payload, None],
        named: bool = False,
        text_frame: TextFrame | None = None,
    ) -> None:
        self._payloads, self._named, self._text_frame = payloads, named, text_frame
        super().__init__(())  # no body iterator: stream_response reads the payloads

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._server_send: Send | None = scope.get(SERVER_SEND)
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
        if self._text_frame is not None:
            self._text_frame.send = _sender(self._server_send or send)
        try:
            async for payload in self._payloads:
                await send(_more(payload if isinstance(payload, bytes) else self._event(payload)))
        except ServiceUnavailableError as err:
            head = "event: error\n" if self._named else ""
            error = error_payload(503, str(err)).model_dump_json()
            await send(_more(f"{head}data: {error}\n\n".encode()))
        finally:
            if self._text_frame is not None:
                self._text_frame.send = None
        if not self._named:
            await send(_more(b"data: [DONE]\n\n"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _event(self, payload: BaseModel | dict[str, Any] | str) -> bytes:
        head = _event_line(payload) if self._named else ""
        return f"{head}data: {_dump(payload)}\n\n".encode()


def _more(event: bytes) -> dict[str, Any]:
    """The ASGI message sending `event`, more to come."""
    return {"type": "http.response.body", "body": event, "more_body": True}


def with_server_send(app: ASGIApp) -> ASGIApp:
    """`app` with the server's own `send` kept in each HTTP scope (under SERVER_SEND): a
    stream's frames written from outside its task go to the server past the framework's send
    wrappers, which watch for nothing but the response's start (and that has gone through
    them)."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return asgi


def _sender(send: Send) -> FrameSend:
    """`send` of a body event, run synchronously as far as it goes: the server writes at once
    unless the connection's buffer is full, and then the rest is an awaitable to finish."""

    def write(event: bytes) -> Awaitable[None] | None:
        step = send(_more(event)).__await__()
        try:
            waited = next(step)
        except StopIteration:
            return None
        return _finish(step, waited)

    return write


async def _finish(step: Generator[Any, None, None], waited: Any) -> None:
    """The rest of a send that stopped on the future `waited` (the server's flow control);
    a failure is the connection's, which the stream's next write meets too."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        while True:
            if waited is None:  # a bare yield: asyncio.sleep(0)
                await asyncio.sleep(0)
            else:
                await waited
            try:
                waited = next(step)
            except StopIteration:
                return


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
