"""FastAPI app over a TokenizerManager: OpenAI-compatible and native endpoints.

    POST /v1/completions, POST /v1/chat/completions, GET /v1/models    (OpenAI)
    POST /generate                                                      (native)
    GET /health, GET /health_generate, GET /get_server_info, GET /metrics

Every 4xx/5xx body is `{"error": {"message", "type", "param", "code"}}`: bad input 400 (`param`
names the field), missing or wrong API key 401, unknown model 404 (`model_not_found`), unknown
route 404, body over --max-request-body-bytes 413 (before the body is read), scheduler gone 503.
Tokenization and chat-template rendering run in a worker thread, so the event loop (and /health)
stays responsive whatever a request carries. Streams are server-sent events (`data: {...}`, then
`data: [DONE]`); a client that goes away mid-stream aborts its request, which frees its KV.
With `--api-key`, every route except /health and /metrics needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replaylm.entrypoints.openai_protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    REQUEST_MODELS,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    NativeGenerateRequest,
    UsageInfo,
)
from replaylm.runtime.errors import RequestError, ServiceUnavailableError
from replaylm.runtime.io_struct import GenerateOutput, GenerateRequest, TokenLogprob
from replaylm.runtime.request import FinishReason
from replaylm.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
_FIELD_NAMES = frozenset(name for model in REQUEST_MODELS for name in model.model_fields)
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class APIError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's own (unknown route, wrong method) included, gets the body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, str(err), err.param, err.code)

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, err: RequestError) -> JSONResponse:
        return error_response(400, str(err), err.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(ServiceUnavailableError)
    async def unavailable(_: Request, err: ServiceUnavailableError) -> JSONResponse:
        return error_response(503, str(err))

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(err).__name__}: {err}")


class _BodySizeLimit:
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


# ---- request parsing ------------------------------------------------------------------------


async def _parse(request: Request, model: type[M]) -> M:
    """The JSON body validated as `model`; APIError(400) naming the field otherwise."""
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})") from err
    try:
        return model.model_validate_json(text)
    except ValidationError as err:
        raise _validation_error(err) from err


def _validation_error(err: ValidationError) -> APIError:
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['ctx']['error']}")
    if first["type"] == "extra_forbidden":
        param = _param(first["loc"], unknown_last=True)
        return APIError(400, f"unsupported parameter: {param}", param)
    param = _param(first["loc"])
    messages = dict.fromkeys(
        e["msg"].removeprefix("Value error, ") for e in errors if _param(e["loc"]) == param
    )
    message = "; ".join(messages)
    return APIError(400, f"{param}: {message}" if param else f"request body: {message}", param)


def _param(loc: tuple[int | str, ...], unknown_last: bool = False) -> str | None:
    """`('messages', 0, 'content', 'str')` -> `messages[0].content` (union member tags dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES or unknown_last and i == len(loc) - 1:
            out += f".{part}" if out else part
    return out or None


@contextlib.contextmanager
def _prompt_param(name: str) -> Iterator[None]:
    """Report the tokenizer manager's prompt errors under this endpoint's field name."""
    try:
        yield
    except RequestError as err:
        if err.param in ("prompt", "input_ids"):
            raise RequestError(str(err), name) from err
        raise


def _require_api_key(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    return check


# ---- responses ------------------------------------------------------------------------------


class _EventStream(StreamingResponse):
    """SSE response that closes its body generator however the stream ends, so a client that
    disconnects aborts the request at once (not when the generator is garbage-collected)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[str, None]) -> None:
        super().__init__(body)
        self._body = body  # `body_iterator` is the same object, typed only as an iterable

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()


async def _sse(
    payloads: AsyncGenerator[BaseModel | dict[str, Any], None],
) -> AsyncGenerator[str, None]:
    """`data: <json>` events, then `data: [DONE]`; a scheduler failure mid-stream is sent as an
    error event (the status line is already out)."""
    try:
        async for payload in payloads:
            yield f"data: {_dump(payload)}\n\n"
    except ServiceUnavailableError as err:
        error = ErrorDetail(message=str(err), type="server_error")
        yield f"data: {ErrorResponse(error=error).model_dump_json()}\n\n"
    finally:
        await payloads.aclose()
    yield "data: [DONE]\n\n"


def _dump(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return payload.model_dump_json()
    return json.dumps(payload, ensure_ascii=False)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _finish(reason: FinishReason | None) -> str | None:
    return reason.type if reason is not None else None


def _usage(out: GenerateOutput) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        total_tokens=out.prompt_tokens + out.completion_tokens,
    )


@dataclass
class _Result:
    """A whole (non-streamed) generation; `last` is its final output (finish reason, usage)."""

    last: GenerateOutput
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]

    @classmethod
    async def collect(cls, stream: AsyncIterator[GenerateOutput]) -> _Result:
        text, token_ids, logprobs, last = "", [], [], None
        async for out in stream:
            text += out.text
            token_ids += out.token_ids
            logprobs += out.logprobs or []
            last = out
        # `_start` awaited the stream's first output before handing it over: never empty
        assert last is not None
        return cls(last, text, token_ids, logprobs)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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


async def _prepend(
    first: GenerateOutput, rest: AsyncGenerator[GenerateOutput, None]
) -> AsyncGenerator[GenerateOutput, None]:
    try:
        yield first
        async for out in rest:
            yield out
    finally:
        await rest.aclose()


class _Serving:
    """The route handlers, bound to one TokenizerManager."""

    def __init__(self, tm: Any) -> None:
        self.tm = tm
        self.created = int(time.time())
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)

    def _decode_token(self, token_id: int) -> str:
        if self.tm.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tm.tokenizer.decode([token_id])

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.tm.served_model_name:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves "
                f"`{self.tm.served_model_name}`",
                "model",
                "model_not_found",
            )

    async def _start(
        self, request: Request, req: GenerateRequest, prompt_param: str
    ) -> AsyncGenerator[GenerateOutput, None]:
        """Start generating and wait for the first output, so that bad input raises here,
        before a (streaming) response has begun."""
        gen = self.tm.generate(req)
        with _prompt_param(prompt_param):
            first = await _unless_disconnected(request, gen.__anext__())
        return _prepend(first, gen)

    # ---- OpenAI ------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        with _prompt_param("prompt"):
            ids = body.prompt
            if not isinstance(ids, list):
                ids = await run_in_threadpool(self.tm.encode, body.prompt)
        params = body.sampling_params(body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)
        req = GenerateRequest(ids, params, top_logprobs=body.logprobs)
        stream = await self._start(request, req, "prompt")
        rid, model = f"cmpl-{req.rid}", self.tm.served_model_name
        if body.stream:
            return _EventStream(_sse(self._completion_chunks(stream, body, rid)))
        res = await _unless_disconnected(request, _Result.collect(stream))
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._completion_logprobs(res.logprobs, body.logprobs, 0)[0]
        choice = CompletionChoice(
            text=res.text, logprobs=logprobs, finish_reason=_finish(res.last.finish_reason)
        )
        return _json(
            CompletionResponse(id=rid, model=model, choices=[choice], usage=_usage(res.last))
        )

    async def _completion_chunks(
        self, stream: AsyncIterator[GenerateOutput], body: CompletionRequest, rid: str
    ) -> AsyncGenerator[CompletionResponse, None]:
        model, offset, last = self.tm.served_model_name, 0, None
        async for out in stream:
            last, logprobs = out, None
            if body.logprobs is not None and out.logprobs:
                logprobs, offset = self._completion_logprobs(out.logprobs, body.logprobs, offset)
            if out.text or logprobs or out.finish_reason:
                choice = CompletionChoice(
                    text=out.text, logprobs=logprobs, finish_reason=_finish(out.finish_reason)
                )
                yield CompletionResponse(id=rid, model=model, choices=[choice])
        if body.include_usage and last is not None:
            yield CompletionResponse(id=rid, model=model, choices=[], usage=_usage(last))

    def _completion_logprobs(
        self, lps: list[TokenLogprob], k: int, offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Legacy-format logprobs; `offset` is where the first token starts in the text."""
        out = CompletionLogprobs()
        for lp in lps:
            token = self.token_text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            top: dict[str, float] = {}
            for token_id, logprob in lp.top[:k]:
                top.setdefault(self.token_text(token_id), logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out, offset

    async def chat_completions(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        with _prompt_param("messages"):
            messages = [m.template_dict() for m in body.messages]
            ids = await run_in_threadpool(self.tm.encode_chat, messages)
        max_tokens = body.requested_max_tokens or max(1, self.tm.context_len - len(ids))
        top_k = (body.top_logprobs or 0) if body.logprobs else None
        req = GenerateRequest(ids, body.sampling_params(max_tokens), top_logprobs=top_k)
        stream = await self._start(request, req, "messages")
        rid, model = f"chatcmpl-{req.rid}", self.tm.served_model_name
        if body.stream:
            return _EventStream(_sse(self._chat_chunks(stream, body, rid, top_k)))
        res = await _unless_disconnected(request, _Result.collect(stream))
        choice = ChatChoice(
            message=ChatMessageOut(content=res.text),
            logprobs=self._chat_logprobs(res.logprobs, top_k),
            finish_reason=_finish(res.last.finish_reason),
        )
        return _json(
            ChatCompletionResponse(id=rid, model=model, choices=[choice], usage=_usage(res.last))
        )

    async def _chat_chunks(
        self,
        stream: AsyncIterator[GenerateOutput],
        body: ChatCompletionRequest,
        rid: str,
        top_k: int | None,
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        model, last = self.tm.served_model_name, None
        opening = ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))
        yield ChatCompletionChunk(id=rid, model=model, choices=[opening])
        async for out in stream:
            last, logprobs = out, self._chat_logprobs(out.logprobs or [], top_k)
            if out.text or (logprobs and logprobs.content) or out.finish_reason:
                choice = ChatStreamChoice(
                    delta=DeltaMessage(content=out.text),
                    logprobs=logprobs,
                    finish_reason=_finish(out.finish_reason),
                )
                yield ChatCompletionChunk(id=rid, model=model, choices=[choice])
        if body.include_usage and last is not None:
            yield ChatCompletionChunk(id=rid, model=model, choices=[], usage=_usage(last))

    def _chat_logprobs(self, lps: list[TokenLogprob], k: int | None) -> ChatLogprobs | None:
        if k is None:
            return None

        def entry(token_id: int, logprob: float) -> ChatTopLogprob:
            token = self.token_text(token_id)
            return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **entry(lp.token_id, lp.logprob).model_dump(),
                    top_logprobs=[entry(t, v) for t, v in lp.top[:k]],
                )
                for lp in lps
            ]
        )

    async def models(self) -> Response:
        card = ModelCard(
            id=self.tm.served_model_name, created=self.created, max_model_len=self.tm.context_len
        )
        return _json(ModelList(data=[card]))

    # ---- native ------------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        """Non-stream: `{"text", "output_ids", "meta_info"}`; stream: one such object per
        increment (`text` and `output_ids` new since the previous event)."""
        body = await _parse(request, NativeGenerateRequest)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "send exactly one of `text` and `input_ids`", "text")
        prompt_param = "text" if body.text is not None else "input_ids"
        with _prompt_param(prompt_param):
            if body.input_ids is not None:
                ids = body.input_ids
            else:
                ids = await run_in_threadpool(self.tm.encode, body.text)
        try:
            params = SamplingParams.from_dict(body.sampling_params)
        except (ValueError, TypeError) as err:
            name = str(err).split(" ", 1)[0]
            param = f"sampling_params.{name}" if name in _SAMPLING_FIELDS else "sampling_params"
            raise APIError(400, str(err), param) from err
        top_k = body.top_logprobs_num if body.return_logprob else None
        req = GenerateRequest(ids, params, top_logprobs=top_k)
        stream = await self._start(request, req, prompt_param)
        if body.stream:
            return _EventStream(_sse(self._native_chunks(stream, req.rid)))
        res = await _unless_disconnected(request, _Result.collect(stream))
        meta = self._native_meta(req.rid, res.last, res.logprobs if top_k is not None else None)
        return JSONResponse({"text": res.text, "output_ids": res.token_ids, "meta_info": meta})

    async def _native_chunks(
        self, stream: AsyncIterator[GenerateOutput], rid: str
    ) -> AsyncGenerator[dict[str, Any], None]:
        async for out in stream:
            meta = self._native_meta(rid, out, out.logprobs)
            yield {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}

    @staticmethod
    def _native_meta(
        rid: str, out: GenerateOutput, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "finish_reason": out.finish_reason.to_dict() if out.finish_reason else None,
        }
        if logprobs is not None:
            meta["output_token_logprobs"] = [dataclasses.asdict(lp) for lp in logprobs]
        return meta

    # ---- operations --------------------------------------------------------------------------

    async def health(self) -> Response:
        if not self.tm.healthy():
            return error_response(503, "the scheduler process is not running")
        return JSONResponse({"status": "ok"})

    async def health_generate(self) -> Response:
        if not self.tm.healthy() or not await self.tm.health_generate():
            return error_response(503, "could not generate a token")
        return JSONResponse({"status": "ok"})

    async def server_info(self) -> Response:
        return JSONResponse(self.tm.server_info())

    async def metrics(self) -> Response:
        body, content_type = self.tm.metrics.render()
        return Response(body, media_type=content_type)


def create_app(tokenizer_manager: Any) -> FastAPI:
    """The app serving `tokenizer_manager` (a replaylm TokenizerManager, or any object with its
    interface: served_model_name, context_len, tokenizer, server_args (api_key,
    max_request_body_bytes), metrics, healthy, encode, encode_chat, generate, health_generate,
    server_info). `encode` and `encode_chat` run in worker threads."""
    app = FastAPI(title="replaylm", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    app.add_middleware(_BodySizeLimit, limit=tokenizer_manager.server_args.max_request_body_bytes)
    serving = _Serving(tokenizer_manager)
    auth = [Depends(_require_api_key(tokenizer_manager.server_args.api_key))]
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/metrics", serving.metrics, methods=["GET"])
    routes: list[tuple[str, Callable[..., Awaitable[Response]], str]] = [
        ("/v1/completions", serving.completions, "POST"),
        ("/v1/chat/completions", serving.chat_completions, "POST"),
        ("/v1/models", serving.models, "GET"),
        ("/generate", serving.generate, "POST"),
        ("/health_generate", serving.health_generate, "GET"),
        ("/get_server_info", serving.server_info, "GET"),
    ]
    for path, handler, method in routes:
        app.add_api_route(path, handler, methods=[method], dependencies=auth)
    return app
