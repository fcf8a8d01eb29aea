"""Errors the tokenizer manager raises to the HTTP layer, which maps them to status codes."""

from __future__ import annotations


class RequestError(ValueError):
    """A bad request (HTTP 400). `param` names the offending field when there is one; `code` is
    the OpenAI error code clients match on, where there is one (`context_length_exceeded`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ServiceUnavailableError(RuntimeError):
    """The scheduler process is gone or shutting down (HTTP 503)."""
