"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, with vLLM's shapes: the
server's own encoding of a prompt (or of chat messages, as the chat route renders them), the text
of token ids, and the tokenizer's special tokens and chat template (what remote-tokenizer clients
such as lm-eval-harness's read)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from replaylm.entrypoints.http_errors import APIError
from replaylm.entrypoints.http_parsing import parse_body, prompt_param
from replaylm.entrypoints.http_streaming import json_response
from replaylm.entrypoints.openai_chat_protocol import TokenizeRequest
from replaylm.entrypoints.openai_protocol import DetokenizeRequest
from replaylm.entrypoints.openai_responses import DetokenizeResponse, TokenizeResponse
from replaylm.entrypoints.serving_chat import chat_prompt, offered_tools, template_errors
from replaylm.entrypoints.serving_common import ServingContext
from replaylm.model_loader.tokenizer import tokenizer_class_name
from replaylm.runtime.errors import RequestError


class TokenizeRoutes:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, request: Request) -> Response:
        """`prompt` (`add_special_tokens` defaults to true, as for completions) or `messages`
        (rendered as the chat route does, with the same options) -> `{"count",
        "max_model_len", "tokens"}` (and `token_strs` with `return_token_strs`)."""
        body = await parse_body(request, TokenizeRequest)
        self.ctx.check_model(body.model)
        tm = self.ctx.tm
        if body.prompt is not None:
            with prompt_param("prompt"):
                special = body.add_special_tokens is not False
                ids = await run_in_threadpool(tm.encode, body.prompt, add_special_tokens=special)
        else:
            assert body.messages is not None  # check() saw one of them
            messages, options = chat_prompt(self.ctx, body, body.messages, offered_tools(body))
            with prompt_param("messages"), template_errors(body.messages):
                ids = await run_in_threadpool(tm.encode_chat, messages, **options)
        strs = tm.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return json_response(
            TokenizeResponse(
                count=len(ids), max_model_len=tm.context_len, tokens=ids, token_strs=strs
            )
        )

    async def detokenize(self, request: Request) -> Response:
        """`{"tokens"}` -> `{"prompt"}`; ids outside the vocabulary are a 400 on `tokens`."""
        body = await parse_body(request, DetokenizeRequest)
        self.ctx.check_model(body.model)
        tm = self.ctx.tm
        if tm.tokenizer is None:
            raise RequestError("this model has no tokenizer", "tokens")
        vocab = min(tm.vocab_size, len(tm.tokenizer))
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise RequestError(
                f"tokens must be ids in [0, {vocab}): {bad[0]} is outside the vocabulary",
                "tokens",
            )
        text = await run_in_threadpool(tm.tokenizer.decode, body.tokens)
        return json_response(DetokenizeResponse(prompt=text))

    async def tokenizer_info(self) -> Response:
        """`{"tokenizer_class", "eos_token", "bos_token", "pad_token", "chat_template",
        "model_max_length"}`; 404 when the model has no tokenizer."""
        tokenizer = self.ctx.tm.tokenizer
        if tokenizer is None:
            raise APIError(404, "this model has no tokenizer")
        return JSONResponse(
            {
                "tokenizer_class": tokenizer_class_name(tokenizer),
                "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token,
                "pad_token": tokenizer.pad_token,
                "chat_template": tokenizer.chat_template,
                "model_max_length": self.ctx.tm.context_len,
            }
        )
