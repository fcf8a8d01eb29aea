"""Errors as the HTTP API answers them: `{"error": {"message", "type", "param", "code"}}` for
every 4xx/5xx, FastAPI's own (unknown route, wrong method) included."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from replaylm.entrypoints.openai_responses import ErrorDetail, ErrorResponse
from replaylm.runtime.errors import RequestError, ServiceUnavailableError


class APIError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_payload(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = error_payload(status, message, param, code)
    return JSONResponse(body.model_dump(), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, str(err), err.param, err.code)

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, err: RequestError) -> JSONResponse:
        return error_response(400, str(err), err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(ServiceUnavailableError)
    async def unavailable(_: Request, err: ServiceUnavailableError) -> JSONResponse:
        return error_response(503, str(err))

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(err).__name__}: {err}")
