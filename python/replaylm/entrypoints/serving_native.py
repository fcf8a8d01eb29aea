"""`POST /generate`, the native route: SGLang-style `{"text" | "input_ids", "sampling_params"}`
-> `{"text", "output_ids", "meta_info"}`, whole or one such object per increment."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from replaylm.entrypoints.choices import ChoiceOutput, collect, start_choices
from replaylm.entrypoints.http_errors import APIError
from replaylm.entrypoints.http_parsing import parse_body, prompt_param
from replaylm.entrypoints.http_streaming import EventStream, unless_disconnected
from replaylm.entrypoints.openai_protocol import NativeGenerateRequest
from replaylm.entrypoints.serving_common import ServingContext, tokenize
from replaylm.runtime.io_struct import GenerateOutput, GenerateRequest, TokenLogprob
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.stats import spec_meta_info

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class NativeGenerateRoute:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def handle(self, request: Request) -> Response:
        """Stream: `text` and `output_ids` new since the previous event."""
        body = await parse_body(request, NativeGenerateRequest)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "send exactly one of `text` and `input_ids`", "text")
        param = "text" if body.text is not None else "input_ids"
        with prompt_param(param):
            if body.text is not None:
                ids = await tokenize(len(body.text), self.ctx.tm.encode, body.text)
            else:
                ids = body.input_ids
        try:
            params = SamplingParams.from_dict(body.sampling_params)
        except (ValueError, TypeError) as err:
            name = str(err).split(" ", 1)[0]
            field = f"sampling_params.{name}" if name in _SAMPLING_FIELDS else "sampling_params"
            raise APIError(400, str(err), field) from err
        top_k = body.top_logprobs_num if body.return_logprob else None
        inputs = _InputLogprobs.asked(body, ids)
        prompt_k = body.top_logprobs_num if inputs is not None else None
        req = GenerateRequest(ids, params, top_logprobs=top_k, prompt_logprobs=prompt_k)
        stream = await start_choices(self.ctx.tm, request, [req], param)
        if body.stream:
            return EventStream(_chunks(stream, req.rid, inputs, body.top_logprobs_num))
        results, _ = await unless_disconnected(request, collect(stream))
        res = results[0]
        logprobs = res.logprobs if top_k is not None else None
        meta = _meta(req.rid, res.last, logprobs, body.top_logprobs_num)
        if inputs is not None and res.prompt_logprobs is not None:
            meta.update(inputs.meta(res.prompt_logprobs))
        return JSONResponse({"text": res.text, "output_ids": res.token_ids, "meta_info": meta})


@dataclasses.dataclass(frozen=True)
class _InputLogprobs:
    """SGLang's prompt logprobs, asked by `logprob_start_len`: those of prompt tokens `start`
    on, with the `k` most likely tokens at each."""

    ids: list[int]
    start: int
    k: int

    @classmethod
    def asked(cls, body: NativeGenerateRequest, ids: list[int]) -> _InputLogprobs | None:
        start = body.logprob_start_len
        if not body.return_logprob or start is None or start == -1:
            return None
        if start >= len(ids):
            raise APIError(
                400,
                f"logprob_start_len ({start}) must be smaller than the prompt's length "
                f"({len(ids)} tokens)",
                "logprob_start_len",
            )
        return cls(ids, start, body.top_logprobs_num)

    def meta(self, lps: list[TokenLogprob | None]) -> dict[str, Any]:
        """`input_token_logprobs` ([logprob, token id, text] each; the text is null, as SGLang's
        without `return_text_in_logprobs`; the first prompt token, which nothing predicts, has
        a null logprob) and, when k > 0, `input_top_logprobs` (null for that first token)."""
        lps = lps[self.start :]
        ids = self.ids[self.start :]
        meta: dict[str, Any] = {
            "input_token_logprobs": [
                [lp.logprob if lp is not None else None, token_id, None]
                for token_id, lp in zip(ids, lps, strict=True)
            ]
        }
        if self.k > 0:
            meta["input_top_logprobs"] = [
                [[v, t, None] for t, v in lp.top] if lp is not None else None for lp in lps
            ]
        return meta


async def _chunks(
    stream: AsyncIterator[ChoiceOutput], rid: str, inputs: _InputLogprobs | None, top_k: int
) -> AsyncGenerator[dict[str, Any], None]:
    """The prompt logprobs ride on the first chunk, the one they arrive with."""
    async for c in stream:
        meta = _meta(rid, c.out, c.out.logprobs, top_k)
        if inputs is not None and c.out.prompt_logprobs is not None:
            meta.update(inputs.meta(c.out.prompt_logprobs))
        yield {"text": c.out.text, "output_ids": c.out.token_ids, "meta_info": meta}


def _meta(
    rid: str, out: GenerateOutput, logprobs: list[TokenLogprob] | None, top_k: int
) -> dict[str, Any]:
    """SGLang's meta_info; with logprobs, `output_token_logprobs` ([logprob, token id, text]
    each, the text null as SGLang's without `return_text_in_logprobs`) and, when `top_k` > 0,
    `output_top_logprobs` (the k most likely of each position, in that shape)."""
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": out.finish_reason.to_dict() if out.finish_reason else None,
        **spec_meta_info(out.spec_verify_ct, out.spec_accepted),
    }
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in logprobs]
        if top_k > 0:
            meta["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in logprobs]
    return meta
