"""`POST /invocations`, SageMaker's route as vLLM serves it: a body with `messages` is a chat
completion, one with `prompt` a completion (chat first, vLLM's order)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import Response

from replaylm.entrypoints.http_errors import APIError
from replaylm.entrypoints.serving_chat import ChatRoute
from replaylm.entrypoints.serving_completions import CompletionsRoute


class InvocationsRoute:
    def __init__(self, chat: ChatRoute, completions: CompletionsRoute) -> None:
        self.chat, self.completions = chat, completions

    async def handle(self, request: Request) -> Response:
        """The body is read twice (Starlette keeps it), here to dispatch, then by the route."""
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if isinstance(body, dict) and "messages" in body:
            return await self.chat.handle(request)
        # what is no JSON object, the completions route reports as it reports any bad body
        if not isinstance(body, dict) or "prompt" in body:
            return await self.completions.handle(request)
        raise APIError(
            400,
            "an /invocations body needs `messages` (a chat completion) or `prompt` (a completion)",
            "messages",
        )
