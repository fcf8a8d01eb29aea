"""Generation of a request's choices: each prompt is one GenerateRequest of `n` choices (the
tokenizer manager yields every choice's outputs, tagged with its `index`); the prompts run
concurrently and their outputs are merged into one stream, each tagged with its index in the
response (`prompt_index * n + choice`, OpenAI's order). Whole results and usage are built
from that stream."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from fastapi import Request

from replaylm.entrypoints.http_parsing import prompt_param
from replaylm.entrypoints.http_streaming import unless_disconnected
from replaylm.entrypoints.openai_responses import PromptTokensDetails, UsageInfo
from replaylm.runtime.io_struct import GenerateOutput, GenerateRequest, TextFrame, TokenLogprob


@dataclass
class ChoiceOutput:
    """One output increment of the choice at `index` in the response."""

    index: int
    prompt_index: int
    out: GenerateOutput


C = TypeVar("C", ChoiceOutput, ChoiceOutput | bytes)  # a stream's items, without or with frames


@overload
async def start_choices(
    tm: Any, request: Request, reqs: list[GenerateRequest], param: str
) -> AsyncGenerator[ChoiceOutput, None]: ...


@overload
async def start_choices(
    tm: Any,
    request: Request,
    reqs: list[GenerateRequest],
    param: str,
    text_frame: TextFrame | None,
) -> AsyncGenerator[ChoiceOutput | bytes, None]: ...


async def start_choices(
    tm: Any,
    request: Request,
    reqs: list[GenerateRequest],
    param: str,
    text_frame: TextFrame | None = None,
) -> AsyncGenerator[ChoiceOutput | bytes, None]:
    """Start every request and wait for each one's first output, so that bad input raises
    here (RequestError, reported under `param`), before a (streaming) response has begun.
    `text_frame` (one request only: its choices' indexes are the response's): a text-only
    increment comes rendered by it (`TokenizerManager.generate`)."""
    if text_frame is not None and len(reqs) != 1:
        raise ValueError("text frames number the choices of one request")
    gens = [tm.generate(req, text_frame) for req in reqs]
    try:
        with prompt_param(param):
            firsts = await unless_disconnected(request, _first_outputs(gens))
    except BaseException:
        for gen in gens:
            await gen.aclose()
        raise
    return _merge(reqs, gens, firsts)


async def _first_outputs(
    gens: list[AsyncGenerator[GenerateOutput | bytes, None]],
) -> list[GenerateOutput]:
    """Every generator's first output; when one fails, the others are cancelled (aborted)."""

    async def first(gen: AsyncGenerator[GenerateOutput | bytes, None]) -> GenerateOutput:
        out = await gen.__anext__()
        assert isinstance(out, GenerateOutput)  # a choice's first increment is never a frame
        return out

    if len(gens) == 1:  # nothing to cancel: no task
        return [await first(gens[0])]

    tasks = [asyncio.ensure_future(first(gen)) for gen in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merge(
    reqs: list[GenerateRequest],
    gens: list[AsyncGenerator[GenerateOutput | bytes, None]],
    firsts: list[GenerateOutput],
) -> AsyncGenerator[ChoiceOutput | bytes, None]:
    """The outputs of all `gens` as they come (one prompt's frames passed on as they are).
    Closing this generator closes them all (which aborts what is still running)."""
    if len(gens) == 1:  # one prompt: its outputs in order, with no task and queue hop per output
        try:
            yield ChoiceOutput(firsts[0].index, 0, firsts[0])
            async for out in gens[0]:
                yield out if isinstance(out, bytes) else ChoiceOutput(out.index, 0, out)
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, GenerateOutput | bytes | Exception | None]] = asyncio.Queue()
    for p, out in enumerate(firsts):
        queue.put_nowait((p, out))

    async def pump(p: int, gen: AsyncGenerator[GenerateOutput | bytes, None]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((p, out))
        except Exception as err:  # the scheduler went away: the consumer raises it
            queue.put_nowait((p, err))
        else:
            queue.put_nowait((p, None))

    tasks = [asyncio.create_task(pump(p, gen)) for p, gen in enumerate(gens)]
    try:
        running = len(gens)
        while running:
            p, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            elif isinstance(item, bytes):  # several prompts take no text frames
                raise AssertionError("a text frame in a stream of several prompts")
            else:
                yield ChoiceOutput(p * reqs[p].n + item.index, p, item)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()


@dataclass
class ChoiceResult:
    """A whole (non-streamed) choice; `last` is its final output (finish reason, usage)."""

    index: int
    prompt_index: int
    last: GenerateOutput
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: GenerateOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out


async def collect(stream: AsyncIterator[ChoiceOutput]) -> tuple[list[ChoiceResult], UsageInfo]:
    """Every choice in full, in index order, and the request's usage."""
    results: dict[int, ChoiceResult] = {}
    usage = UsageCounter()
    async for c in stream:
        usage.add(c)
        if c.index not in results:
            results[c.index] = ChoiceResult(c.index, c.prompt_index, c.out)
        results[c.index].add(c.out)
    return [results[i] for i in sorted(results)], usage.total()


def finish_reason(out: GenerateOutput) -> str | None:
    return out.finish_reason.type if out.finish_reason is not None else None


def matched_stop(out: GenerateOutput) -> int | str | None:
    """SGLang's `matched_stop`: the stop string or token id (EOS included) that ended the choice;
    None while it runs and when it ended otherwise (length, abort)."""
    reason = out.finish_reason
    return reason.matched if reason is not None and reason.type == "stop" else None


async def with_stop_strings(stream: AsyncGenerator[C, None]) -> AsyncGenerator[C, None]:
    """vLLM's `include_stop_str_in_output`: each choice's text ends with the stop string that
    ended it. The engine cuts the text at the string's first match, so appending it is exact.
    Frames pass as they are (a finish never comes as one)."""
    try:
        async for c in stream:
            if isinstance(c, bytes):
                yield c
                continue
            stop = matched_stop(c.out)
            if isinstance(stop, str):
                c = dataclasses.replace(c, out=dataclasses.replace(c.out, text=c.out.text + stop))
            yield c
    finally:
        await stream.aclose()


def _usage(prompt: int, completion: int, cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class UsageCounter:
    """Token counts as outputs arrive: each prompt counted once however many choices it has
    (OpenAI's usage for `n`), each choice's output tokens."""

    def __init__(self) -> None:
        self._prompts: dict[int, tuple[int, int]] = {}  # prompt index -> (tokens, cached)
        self._completions: dict[int, int] = {}  # choice index -> tokens so far

    def add(self, c: ChoiceOutput) -> None:
        self._prompts[c.prompt_index] = (c.out.prompt_tokens, c.out.cached_tokens)
        self._completions[c.index] = c.out.completion_tokens

    @staticmethod
    def so_far(c: ChoiceOutput) -> UsageInfo:
        """`c`'s choice's usage so far (vLLM's continuous usage stats): built only when a
        stream asks for it, as it would cost every streamed chunk."""
        return _usage(c.out.prompt_tokens, c.out.completion_tokens, c.out.cached_tokens)

    def total(self) -> UsageInfo:
        prompts = self._prompts.values()
        return _usage(
            sum(tokens for tokens, _ in prompts),
            sum(self._completions.values()),
            sum(cached for _, cached in prompts),
        )
