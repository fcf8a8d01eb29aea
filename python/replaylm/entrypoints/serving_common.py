"""What every route shares: the tokenizer manager, the served model's name and card, the system
fingerprint, response ids, token decoding for logprobs, output budgets, and the model's tool-call
format."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

import replaylm
from replaylm.entrypoints.http_errors import APIError
from replaylm.entrypoints.logprob_format import token_id_label
from replaylm.entrypoints.openai_responses import ModelCard
from replaylm.entrypoints.tool_calls import ChatTools
from replaylm.runtime.request_limits import check_context, output_room
from replaylm.server_args import ServerArgs

T = TypeVar("T")

# texts up to this many characters are tokenized on the event loop: handing them to a worker
# thread costs more than encoding them; longer ones go to a thread, so that no stream waits on them
INLINE_TOKENIZE_CHARS = 2048


async def tokenize(chars: int, encode: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`encode(*args, **kwargs)` of `chars` characters of text: on the event loop up to
    INLINE_TOKENIZE_CHARS, else in a worker thread."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return encode(*args, **kwargs)
    return await run_in_threadpool(encode, *args, **kwargs)


def system_fingerprint(tm: Any) -> str:
    """A stable id of what serves: replaylm's version, the model, its sizes and every server
    setting that can change outputs (not the network ones, nor the log level)."""
    args = tm.server_args.redacted()
    settings = {
        f.name: args[f.name]
        for f in dataclasses.fields(ServerArgs)
        if not f.metadata.get("server_only") and f.name != "log_level"
    }
    identity = {
        "replaylm": replaylm.__version__,
        "model": tm.served_model_name,
        "context_len": tm.context_len,
        "vocab_size": tm.vocab_size,
        "settings": settings,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    return f"fp_{digest.hexdigest()[:12]}"


def response_id(prefix: str, request: Any, request_id: str | None, rid: str) -> str:
    """The response's id, as vLLM makes it: `prefix` and the X-Request-Id header's value, else
    the body's `request_id`, else the request's own id."""
    return f"{prefix}-{request.headers.get('x-request-id') or request_id or rid}"


class ServingContext:
    """The state the routes share, bound to one TokenizerManager."""

    def __init__(self, tm: Any) -> None:
        self.tm = tm
        self.created = int(time.time())
        self.fingerprint = system_fingerprint(tm)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)
        # tool calls through the chat template (None: no tokenizer, so no chat either)
        self.chat_tools = ChatTools(tm.tokenizer) if tm.tokenizer is not None else None

    @property
    def model_name(self) -> str:
        return self.tm.served_model_name

    def _decode_token(self, token_id: int) -> str:
        if self.tm.tokenizer is None:
            return token_id_label(token_id)
        return self.tm.tokenizer.decode([token_id])

    def check_model(self, name: str | None) -> None:
        """APIError(404, `model_not_found`) for a model this server does not serve."""
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                "model",
                "model_not_found",
            )

    def model_card(self) -> ModelCard:
        return ModelCard(
            id=self.model_name,
            created=self.created,
            root=self.tm.server_args.model_path,
            max_model_len=self.tm.context_len,
        )

    def output_budget(
        self,
        prompt_len: int,
        requested: int | None,
        prompt_param: str,
        output_param: str,
        default_cap: int | None = None,
    ) -> int:
        """`requested` output tokens, or without one the room the prompt leaves, cut to
        `default_cap`; RequestError (OpenAI's context-overflow error) naming `prompt_param` when
        the prompt leaves no room, `output_param` when it leaves less than `requested`."""
        context_len, kv_tokens = self.tm.context_len, self.tm.max_total_tokens
        check_context(prompt_len, requested, context_len, kv_tokens, prompt_param, output_param)
        if requested is not None:
            return requested
        room = output_room(prompt_len, context_len, kv_tokens)
        return room if default_cap is None else min(default_cap, room)
