"""What stands before every route: the request-body size limit (ASGI middleware) and the API
key (a route dependency)."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replaylm.entrypoints.http_errors import APIError, error_response


class BodySizeLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 at once, from its
    Content-Length before anything is read, or (a chunked body) as soon as the bytes received pass
    the limit, so no handler buffers, parses or tokenizes more than `limit` bytes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    def _error(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.limit} bytes "
            "(--max-request-body-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            err = self._error()
            await error_response(err.status, str(err), code=err.code)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise self._error()  # answered by the APIError handler, inside the app
            return message

        await self.app(scope, counted, send)


def require_api_key(api_key: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency answering 401 unless the request carries `Authorization: Bearer
    <api_key>`."""

    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    return check
