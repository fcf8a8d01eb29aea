"""The operational routes: models (`GET /v1/models`, `GET /v1/models/{id}`), health, one-token
health generation, server info, Prometheus metrics and flushing the prefix cache."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from replaylm.entrypoints.http_errors import error_response
from replaylm.entrypoints.http_streaming import json_response
from replaylm.entrypoints.openai_responses import ModelList
from replaylm.entrypoints.serving_common import ServingContext


class OpsRoutes:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def models(self) -> Response:
        return json_response(ModelList(data=[self.ctx.model_card()]))

    async def model(self, model_id: str) -> Response:
        """The served model's card; 404 (`model_not_found`) for any other id."""
        self.ctx.check_model(model_id)
        return json_response(self.ctx.model_card())

    async def health(self) -> Response:
        if not self.ctx.tm.healthy():
            return error_response(503, "the scheduler process is not running")
        return JSONResponse({"status": "ok"})

    async def health_generate(self) -> Response:
        tm = self.ctx.tm
        if not tm.healthy() or not await tm.health_generate():
            return error_response(503, "could not generate a token")
        return JSONResponse({"status": "ok"})

    async def server_info(self) -> Response:
        return JSONResponse(
            {**self.ctx.tm.server_info(), "system_fingerprint": self.ctx.fingerprint}
        )

    async def metrics(self) -> Response:
        body, content_type = self.ctx.tm.metrics.render()
        return Response(body, media_type=content_type)

    async def flush_cache(self) -> Response:
        """Evict every cached prefix no running request holds (those stay): `{"freed_tokens"}`."""
        if not self.ctx.tm.healthy():
            return error_response(503, "the scheduler process is not running")
        return JSONResponse({"freed_tokens": await self.ctx.tm.flush_cache()})
