"""FastAPI app over a TokenizerManager: OpenAI-compatible, vLLM-compatible and native endpoints.

    POST /v1/completions, POST /v1/chat/completions                    (OpenAI; serving_*)
    POST /v1/responses, GET and DELETE /v1/responses/{id}  (OpenAI's Responses API, over chat)
    POST /invocations                                  (SageMaker's: chat or completions by body)
    GET /v1/models, GET /v1/models/{id}
    POST /tokenize, POST /detokenize, GET /tokenizer_info               (vLLM's shapes)
    POST /generate                                                      (native)
    GET /health, GET /health_generate, GET /get_server_info, GET /metrics, POST /flush_cache

Requests are parsed by `http_parsing` into the models of `openai_protocol` /
`openai_chat_protocol` (unknown fields are ignored and logged; what replaylm cannot honour is
a 400 naming the field). Every 4xx/5xx body is `{"error": {"message", "type", "param", "code"}}`
(`http_errors`): bad input 400 (`param` names the field), missing or wrong API key 401, unknown
model 404 (`model_not_found`), unknown route 404, body over --max-request-body-bytes 413 (before
the body is read), a body declared as other than JSON 415, scheduler gone 503. Tokenization and
chat-template rendering run in a worker thread, so the event loop (and /health) stays responsive
whatever a request carries. Streams are server-sent events (`data: {...}`, then
`data: [DONE]`); a client that goes away mid-stream aborts its request, which frees its KV.
With `--api-key`, every route except /health and /metrics needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response

from replaylm.entrypoints.http_errors import install_error_handlers
from replaylm.entrypoints.http_guards import BodySizeLimit, require_api_key
from replaylm.entrypoints.responses_store import ResponseStore, SharedResponseStore
from replaylm.entrypoints.serving_chat import ChatRoute
from replaylm.entrypoints.serving_common import ServingContext
from replaylm.entrypoints.serving_completions import CompletionsRoute
from replaylm.entrypoints.serving_invocations import InvocationsRoute
from replaylm.entrypoints.serving_native import NativeGenerateRoute
from replaylm.entrypoints.serving_ops import OpsRoutes
from replaylm.entrypoints.serving_responses import ResponsesRoute
from replaylm.entrypoints.serving_tokenize import TokenizeRoutes

RESPONSES_DB = "responses.sqlite"


def create_app(tokenizer_manager: Any, shared_dir: Path | None = None) -> FastAPI:
    """The app serving `tokenizer_manager` (a replaylm TokenizerManager, or any object with its
    interface: served_model_name, context_len, max_total_tokens, vocab_size, tokenizer,
    server_args (api_key, max_request_body_bytes, model_path), metrics, healthy, encode,
    encode_chat, generate, health_generate, server_info, flush_cache). `encode` and `encode_chat`
    run in worker threads. `shared_dir`: with several front ends, the folder they share, where
    the stored responses live (`RESPONSES_DB`, made before they start)."""
    app = FastAPI(title="replaylm", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, limit=tokenizer_manager.server_args.max_request_body_bytes)
    ctx = ServingContext(tokenizer_manager)
    ops, tokenize = OpsRoutes(ctx), TokenizeRoutes(ctx)
    chat, completions = ChatRoute(ctx), CompletionsRoute(ctx)
    store = SharedResponseStore(shared_dir / RESPONSES_DB) if shared_dir else ResponseStore()
    responses = ResponsesRoute(ctx, store)
    app.add_api_route("/health", ops.health, methods=["GET"])
    app.add_api_route("/metrics", ops.metrics, methods=["GET"])
    api_key = tokenizer_manager.server_args.api_key
    # without a key no dependency at all: FastAPI's solving of one costs every request
    auth = [] if api_key is None else [Depends(require_api_key(api_key))]
    routes: list[tuple[str, Callable[..., Awaitable[Response]], str]] = [
        ("/v1/completions", completions.handle, "POST"),
        ("/v1/chat/completions", chat.handle, "POST"),
        ("/v1/responses", responses.create, "POST"),
        ("/v1/responses/{response_id}", responses.retrieve, "GET"),
        ("/v1/responses/{response_id}", responses.delete, "DELETE"),
        ("/invocations", InvocationsRoute(chat, completions).handle, "POST"),
        ("/v1/models", ops.models, "GET"),
        ("/v1/models/{model_id:path}", ops.model, "GET"),
        ("/tokenize", tokenize.tokenize, "POST"),
        ("/detokenize", tokenize.detokenize, "POST"),
        ("/tokenizer_info", tokenize.tokenizer_info, "GET"),
        ("/generate", NativeGenerateRoute(ctx).handle, "POST"),
        ("/health_generate", ops.health_generate, "GET"),
        ("/get_server_info", ops.server_info, "GET"),
        ("/flush_cache", ops.flush_cache, "POST"),
    ]
    for path, handler, method in routes:
        app.add_api_route(path, handler, methods=[method], dependencies=auth)
    return app
