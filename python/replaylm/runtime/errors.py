"""Errors the tokenizer manager raises to the HTTP layer, which maps them to status codes, and
errors told to the user in one line."""

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


# errors whose messages are written for users (bad paths, checkpoints, flags, out of memory)
_USER_ERRORS = (ValueError, OSError, RuntimeError)


def one_line_error(err: BaseException) -> str:
    """`err` as one line for the user: its message, after its type's name unless it is one of
    the errors whose messages are written for users."""
    message = " ".join(str(err).split())
    if isinstance(err, _USER_ERRORS) and message:
        return message
    return f"{type(err).__name__}: {message}" if message else type(err).__name__
