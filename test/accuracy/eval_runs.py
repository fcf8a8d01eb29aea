"""Asking a running server an eval through the eval package (greedy, as `run_eval` asks it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from replaylm.eval.base import Eval
from replaylm.eval.client import OpenAIClient
from replaylm.eval.registry import load_eval
from replaylm.eval.runner import Record, run

from mode_compare import EvalRun

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class EvalSpec:
    """Which questions to ask: the first `num_examples` of eval `name`, with `num_shots` (None:
    the eval's default) and at most `max_tokens` per completion."""

    name: str
    num_examples: int
    num_shots: int | None
    max_tokens: int


def ask(base_url: str, spec: EvalSpec, mode: str, parallel: int) -> EvalRun:
    """Ask the server at `base_url` (no /v1) the questions of `spec`, `parallel` at a time,
    from the shared eval data; `mode` labels the run."""
    ev = load_eval(spec.name, None, spec.num_shots, seed=0)
    records, wall_s = asyncio.run(_ask(f"{base_url}/v1", ev, spec, parallel))
    return EvalRun.of(mode, ev.name, records, wall_s)


async def _ask(api_url: str, ev: Eval, spec: EvalSpec, parallel: int) -> tuple[list[Record], float]:
    async with OpenAIClient(api_url, None, REQUEST_TIMEOUT_S, parallel) as client:
        model = (await client.model_ids())[0]
        return await run(
            ev,
            ev.examples[: spec.num_examples],
            client,
            model,
            spec.max_tokens,
            parallel,
            progress=False,
        )
