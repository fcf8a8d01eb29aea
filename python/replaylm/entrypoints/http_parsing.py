"""Request bodies into request models: media type (415), UTF-8 and JSON (400), validation into
the model with errors naming the field (`messages[0].content`), unknown fields logged and
ignored, then the model's own cross-field checks."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TypeVar

from fastapi import Request
from pydantic import AliasChoices, ValidationError

from replaylm.entrypoints.http_errors import APIError
from replaylm.entrypoints.openai_protocol import RequestModel
from replaylm.runtime.errors import RequestError

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=RequestModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as `model`; APIError(415) for a body declared as another media
    type, APIError(400) naming the field, or RequestError from `model.check()`, otherwise."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(
            415,
            f"the request body must be JSON (Content-Type: application/json), not {media_type}",
            code="unsupported_media_type",
        )
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})") from err
    try:
        body = model.model_validate_json(text)
    except ValidationError as err:
        raise _validation_error(err) from err
    ignored = body.ignored_fields()
    if ignored:
        logger.warning("%s: ignored unknown field(s): %s", request.url.path, ", ".join(ignored))
    body.check()
    return body


def _validation_error(err: ValidationError) -> APIError:
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['ctx']['error']}")
    if first["type"] == "extra_forbidden":
        param = _param(first["loc"], unknown_last=True)
        return APIError(400, f"unsupported parameter: {param}", param)
    # the most specific location: of a union's failed members, the one that got furthest
    param = max((_param(e["loc"]) for e in errors), key=_depth)
    messages = dict.fromkeys(
        e["msg"].removeprefix("Value error, ") for e in errors if _param(e["loc"]) == param
    )
    message = "; ".join(messages)
    return APIError(400, f"{param}: {message}" if param else f"request body: {message}", param)


@functools.cache
def _field_names() -> frozenset[str]:
    """Every request model's field names and aliases: what a validation error's location
    keeps (the rest are union member tags such as `str` or `list[int]`)."""
    names: set[str] = set()
    models: list[type[RequestModel]] = [RequestModel]
    while models:
        model = models.pop()
        models += model.__subclasses__()
        for name, field in model.model_fields.items():
            names.add(name)
            if field.alias:
                names.add(field.alias)
            if isinstance(field.validation_alias, AliasChoices):
                names.update(c for c in field.validation_alias.choices if isinstance(c, str))
    return frozenset(names)


def _param(loc: tuple[int | str, ...], unknown_last: bool = False) -> str | None:
    """`('messages', 0, 'content', 'str')` -> `messages[0].content` (union member tags dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _field_names() or unknown_last and i == len(loc) - 1:
            out += f".{part}" if out else part
    return out or None


def _depth(param: str | None) -> int:
    """How many names and indices `param` has (`messages[0].content` has three)."""
    return 0 if param is None else param.count(".") + param.count("[") + 1


@contextlib.contextmanager
def prompt_param(name: str) -> Iterator[None]:
    """Report the tokenizer manager's prompt errors under this endpoint's field name."""
    try:
        yield
    except RequestError as err:
        if err.param in ("prompt", "input_ids"):
            raise RequestError(str(err), name, err.code) from err
        raise
