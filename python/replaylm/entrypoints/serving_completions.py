"""`POST /v1/completions`: one or several prompts, `n` choices each, `echo`, legacy-format
logprobs, vLLM's `prompt_logprobs`; whole or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from replaylm.entrypoints.choices import (
    ChoiceOutput,
    ChoiceResult,
    UsageCounter,
    collect,
    finish_reason,
    matched_stop,
    start_choices,
    with_stop_strings,
)
from replaylm.entrypoints.chunk_frames import ChunkFrames
from replaylm.entrypoints.http_parsing import parse_body, prompt_param
from replaylm.entrypoints.http_streaming import (
    EventStream,
    json_response,
    unless_disconnected,
)
from replaylm.entrypoints.logprob_format import completion_logprobs, prompt_logprobs
from replaylm.entrypoints.openai_constraints import reported_under
from replaylm.entrypoints.openai_protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from replaylm.entrypoints.openai_responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
)
from replaylm.entrypoints.serving_common import ServingContext, response_id, tokenize
from replaylm.runtime.io_struct import GenerateRequest, TextFrame, TokenLogprob

Entries = list[tuple[int, TokenLogprob | None]]


class CompletionsRoute:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def handle(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        self.ctx.check_model(body.model)
        with prompt_param("prompt"):
            chars = sum(len(p) for p in body.prompts if isinstance(p, str))
            encoded = await tokenize(chars, self._encode, body)
        prompt_ids = [body.truncated_prompt(ids, self.ctx.tm.context_len) for ids in encoded]
        reqs = [self._generate_request(body, ids) for ids in prompt_ids]
        rid = response_id("cmpl", request, body.request_id, reqs[0].rid)
        view = _CompletionView(self.ctx, body, prompt_ids, rid)
        if body.stream:
            text_frame = view.text_frame()
            with reported_under(body.constraint()):
                frames = await start_choices(self.ctx.tm, request, reqs, "prompt", text_frame)
            await self._echo(view)
            if body.include_stop_str_in_output:
                frames = with_stop_strings(frames)
            return EventStream(view.chunks(frames), text_frame=text_frame)
        with reported_under(body.constraint()):
            stream = await start_choices(self.ctx.tm, request, reqs, "prompt")
        await self._echo(view)
        if body.include_stop_str_in_output:
            stream = with_stop_strings(stream)
        results, usage = await unless_disconnected(request, collect(stream))
        return json_response(view.response(results, usage))

    async def _echo(self, view: _CompletionView) -> None:
        """The prompts' texts for `echo`, once the prompts are accepted."""
        if view.body.echo:
            view.prompt_texts = await run_in_threadpool(
                self._prompt_texts, view.body, view.prompt_ids
            )

    def _encode(self, body: CompletionRequest) -> list[list[int]]:
        special = body.add_special_tokens is not False
        return [
            p if isinstance(p, list) else self.ctx.tm.encode(p, add_special_tokens=special)
            for p in body.prompts
        ]

    def _prompt_texts(self, body: CompletionRequest, prompt_ids: list[list[int]]) -> list[str]:
        """The prompts as `echo` returns them: as sent, or token ids (or what truncation kept of
        a text) decoded."""
        as_sent = body.truncate_prompt_tokens is None
        return [
            p if isinstance(p, str) and as_sent else self._decode(ids)
            for p, ids in zip(body.prompts, prompt_ids, strict=True)
        ]

    def _decode(self, ids: list[int]) -> str:
        tokenizer = self.ctx.tm.tokenizer
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def _generate_request(self, body: CompletionRequest, ids: list[int]) -> GenerateRequest:
        if body.max_tokens == 0:  # echo alone: one token is generated and left out
            max_new = 1
        else:
            max_new = self.ctx.output_budget(
                len(ids), body.max_tokens, "prompt", "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS
            )
        asked = [body.prompt_logprobs, body.logprobs if body.echo else None]
        wanted = [k for k in asked if k is not None]
        return GenerateRequest(
            ids,
            body.sampling_params(max_new, "max_tokens", self.ctx.tm.encode),
            top_logprobs=body.logprobs,
            prompt_logprobs=max(wanted) if wanted else None,
            n=body.num_choices,
        )


class _CompletionView:
    """One request's choices as the API shows them."""

    def __init__(
        self, ctx: ServingContext, body: CompletionRequest, prompt_ids: list[list[int]], rid: str
    ) -> None:
        self.ctx, self.body, self.rid = ctx, body, rid
        self.prompt_ids = prompt_ids
        self.prompt_texts: list[str] = []  # `echo`'s, set once the prompts are accepted
        self.n = body.num_choices
        self.created = int(time.time())  # every chunk of a stream shares it
        self.frames = ChunkFrames(self._response([]), _text_choice)

    def text_frame(self) -> TextFrame | None:
        """The event of a text-only increment, rendered where the scheduler's message is read,
        for a stream whose such increments are all `frames.text` chunks (one prompt; no
        logprobs, token ids or usage per chunk; not `max_tokens: 0`); else None."""
        body = self.body
        if (
            len(self.prompt_ids) != 1
            or body.continuous_usage
            or body.logprobs is not None
            or body.return_token_ids
            or body.max_tokens == 0
        ):
            return None
        return TextFrame(self.frames.event)

    def _response(
        self, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.ctx.model_name,
            system_fingerprint=self.ctx.fingerprint,
            choices=choices,
            usage=usage,
        )

    def _content(
        self,
        prompt_index: int,
        text: str,
        logprobs: list[TokenLogprob],
        prompt_lps: list[TokenLogprob | None] | None,
        first: bool,
    ) -> tuple[str, Entries]:
        """A choice's text and logprob entries: the output's, after the prompt's in the
        choice's first increment under `echo`."""
        entries: Entries = [(lp.token_id, lp) for lp in logprobs]
        if self.body.max_tokens == 0:
            text, entries = "", []
        if self.body.echo and first:
            ids = self.prompt_ids[prompt_index]
            lps = prompt_lps if prompt_lps is not None else [None] * len(ids)
            text = self.prompt_texts[prompt_index] + text
            entries = list(zip(ids, lps, strict=True)) + entries
        return text, entries

    def _token_ids(
        self, prompt_index: int, ids: list[int], first: bool
    ) -> tuple[list[int] | None, list[int] | None]:
        """vLLM's `return_token_ids`: (the prompt's ids, in the choice's first increment; the
        output's ids, none under `max_tokens: 0`); (None, None) when not asked."""
        if not self.body.return_token_ids:
            return None, None
        output = [] if self.body.max_tokens == 0 else ids
        return (self.prompt_ids[prompt_index] if first else None), output

    def _logprobs(self, entries: Entries, offset: int) -> tuple[CompletionLogprobs | None, int]:
        if self.body.logprobs is None:
            return None, offset
        return completion_logprobs(
            entries,
            self.body.logprobs,
            offset,
            self.ctx.token_text,
            bool(self.body.return_tokens_as_token_ids),
        )

    def response(self, results: list[ChoiceResult], usage: UsageInfo) -> CompletionResponse:
        choices = []
        for r in results:
            text, entries = self._content(
                r.prompt_index, r.text, r.logprobs, r.prompt_logprobs, first=True
            )
            logprobs, _ = self._logprobs(entries, 0)
            prompt_lps = None
            if self.body.prompt_logprobs is not None:
                k = self.body.prompt_logprobs
                prompt_lps = prompt_logprobs(r.prompt_logprobs, k, self.ctx.token_text)
            prompt_ids, token_ids = self._token_ids(r.prompt_index, r.token_ids, first=True)
            choices.append(
                CompletionChoice(
                    index=r.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(r.last),
                    matched_stop=matched_stop(r.last),
                    prompt_logprobs=prompt_lps,
                    prompt_token_ids=prompt_ids,
                    token_ids=token_ids,
                )
            )
        return self._response(choices, usage)

    async def chunks(
        self, stream: AsyncIterator[ChoiceOutput | bytes]
    ) -> AsyncGenerator[CompletionResponse | str | bytes, None]:
        """The stream's chunks; one that only brings text comes from `ChunkFrames` (here, or
        as the `text_frame` event already rendered)."""
        frames = self.frames
        plain = not self.body.continuous_usage
        usage = UsageCounter()
        offsets: dict[int, int] = {}  # choice index -> characters sent so far
        opened: set[int] = set()  # choices with a chunk sent
        async for c in stream:
            if isinstance(c, bytes):
                yield c
                continue
            usage.add(c)
            first = c.index not in offsets
            text, entries = self._content(
                c.prompt_index, c.out.text, c.out.logprobs or [], c.out.prompt_logprobs, first
            )
            logprobs, offsets[c.index] = self._logprobs(entries, offsets.get(c.index, 0))
            reason = finish_reason(c.out)
            prompt_ids, token_ids = self._token_ids(
                c.prompt_index, c.out.token_ids, c.index not in opened
            )
            if text or entries or reason or token_ids:
                opened.add(c.index)
                if plain and logprobs is None and reason is None and token_ids is None:
                    yield frames.text(c.index, text)
                    continue
                choice = CompletionChoice(
                    index=c.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=reason,
                    matched_stop=matched_stop(c.out),
                    prompt_token_ids=prompt_ids,
                    token_ids=token_ids,
                )
                so_far = usage.so_far(c) if self.body.continuous_usage else None
                yield self._response([choice], so_far)
        if self.body.include_usage:
            yield self._response([], usage.total())


def _text_choice(index: int, text: str) -> CompletionChoice:
    return CompletionChoice(index=index, text=text)
