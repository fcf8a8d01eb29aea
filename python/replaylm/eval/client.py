"""A small async client for the OpenAI endpoints the evals use: GET /models, and POST
/completions or /chat/completions with per-request failures returned as values."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from replaylm.eval.base import Endpoint


class ServerError(Exception):
    """The server cannot be reached, or does not answer like an OpenAI-compatible one."""


@dataclass(frozen=True)
class Reply:
    """One request's outcome: the completion, or `error` (then `text` is empty)."""

    text: str
    finish_reason: str | None
    completion_tokens: int  # from the response's usage; 0 when it has none
    latency_s: float
    error: str | None = None


class OpenAIClient:
    """`base_url` ends in the API root (e.g. http://127.0.0.1:30000/v1). At most
    `max_connections` requests are open at once."""

    def __init__(
        self, base_url: str, api_key: str | None, timeout_s: float, max_connections: int
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url + "/",
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=timeout_s,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def model_ids(self) -> list[str]:
        """The ids listed by GET /models; ServerError when unreachable or not such a list."""
        url = f"{self.base_url}/models"
        try:
            resp = await self._http.get("models")
        except httpx.HTTPError as err:
            raise ServerError(f"cannot reach the server at {url}: {_describe(err)}") from None
        if resp.status_code != 200:
            raise ServerError(f"GET {url} answered {_status_error(resp)}")
        try:
            return [str(m["id"]) for m in resp.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise ServerError(
                f"GET {url} did not return an OpenAI model list: {resp.text[:200]!r}"
            ) from None

    async def create(self, endpoint: Endpoint, body: dict[str, Any]) -> Reply:
        """POST `body` to /completions or /chat/completions (not streamed). A transport error,
        a non-200 status or a malformed response comes back as `Reply.error`."""
        start = time.perf_counter()
        try:
            resp = await self._http.post(endpoint, json=body)
        except httpx.HTTPError as err:
            return Reply("", None, 0, time.perf_counter() - start, _describe(err))
        latency = time.perf_counter() - start
        if resp.status_code != 200:
            return Reply("", None, 0, latency, _status_error(resp))
        try:
            data = resp.json()
            choice = data["choices"][0]
            text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
            tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
            return Reply(text or "", choice.get("finish_reason"), tokens, latency)
        except (ValueError, KeyError, IndexError, TypeError):
            return Reply("", None, 0, latency, f"malformed response: {resp.text[:200]!r}")


def _describe(err: httpx.HTTPError) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _status_error(resp: httpx.Response) -> str:
    """'HTTP 400: <message>', the message taken from an OpenAI error body when there is one."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:200]
    return f"HTTP {resp.status_code}: {message}"
