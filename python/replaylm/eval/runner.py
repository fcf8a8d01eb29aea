"""Ask every example of an eval through the client, at most `parallel` at a time, and grade."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from tqdm import tqdm

from replaylm.eval.base import Eval, Example, Prompt
from replaylm.eval.client import OpenAIClient, Reply

Verdict = Literal["correct", "incorrect", "invalid"]  # invalid: no answer found, or an error


@dataclass(frozen=True)
class Record:
    """One question's full trace, one line of the --dump file."""

    index: int
    question: str
    prompt: Prompt
    completion: str
    finish_reason: str | None
    parsed: Decimal | None
    reference: Decimal
    verdict: Verdict
    error: str | None
    completion_tokens: int
    latency_s: float


async def run(
    ev: Eval,
    examples: list[Example],
    client: OpenAIClient,
    model: str,
    max_tokens: int,
    parallel: int,
    progress: bool = True,
) -> tuple[list[Record], float]:
    """(one record per example, in order; the wall-clock seconds the whole run took). Greedy:
    temperature 0. Failed requests are recorded as invalid with their error."""
    gate = asyncio.Semaphore(parallel)
    bar = tqdm(total=len(examples), desc=ev.name, unit="q", disable=not progress)

    async def ask(index: int, example: Example) -> Record:
        prompt = ev.prompt(example)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "prompt" if ev.endpoint == "completions" else "messages": prompt,
        }
        if ev.stop:
            body["stop"] = ev.stop
        async with gate:
            reply = await client.create(ev.endpoint, body)
        bar.update()
        return grade(index, example, prompt, reply, ev)

    start = time.perf_counter()
    try:
        records = await asyncio.gather(*(ask(i, ex) for i, ex in enumerate(examples)))
    finally:
        bar.close()
    return list(records), time.perf_counter() - start


def grade(index: int, example: Example, prompt: Prompt, reply: Reply, ev: Eval) -> Record:
    """The record of one reply: parsed with `ev.parse`, compared numerically to the reference."""
    parsed = None if reply.error else ev.parse(reply.text)
    verdict: Verdict
    if parsed is None:
        verdict = "invalid"
    else:
        verdict = "correct" if parsed == example.reference else "incorrect"
    return Record(
        index,
        example.question,
        prompt,
        reply.text,
        reply.finish_reason,
        parsed,
        example.reference,
        verdict,
        reply.error,
        reply.completion_tokens,
        reply.latency_s,
    )
