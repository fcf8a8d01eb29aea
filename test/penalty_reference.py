"""The logit adjustments (penalties, logit_bias, min_tokens) written out plainly in torch, one
request at a time from its prompt and output ids, and a recorder of what a Scheduler's sampler
is handed, to compare every sampled row with that reference (CPU and CUDA tests)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch

from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams


def reference_logits(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    eos_ids: Iterable[int],
) -> torch.Tensor:
    """One request's float32 logits row after its penalties, logit_bias and min_tokens, given
    the tokens it had out before this one (`output`)."""
    x = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=x.numel()).to(
        x.device
    )
    seen = counts > 0
    seen[torch.tensor(prompt, device=x.device)] = True
    r = params.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - params.frequency_penalty * counts.to(torch.float32)
    x = x - params.presence_penalty * (counts > 0).to(torch.float32)
    for token, bias in params.logit_bias.items():
        x[token] += bias
    if len(output) < params.min_tokens:
        x[[*eos_ids, *params.stop_token_ids]] = -torch.inf
    return x


@dataclass
class SampledStep:
    """One `Scheduler.draw_tokens` call: each row's seed (which request) and step (tokens out
    before), the model's logits and the logits the sampler saw (None: the raw ones), on the CPU."""

    seeds: list[int]
    steps: list[int]
    raw: torch.Tensor
    adjusted: torch.Tensor | None


def record_sampling(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list[SampledStep]:
    """From now on (until the test ends), every `scheduler.draw_tokens` call is appended to the
    returned list before it runs as it would (the recording waits for the GPU; the results are
    the same)."""
    calls: list[SampledStep] = []
    sample = scheduler.draw_tokens

    def recorded(logits, info, steps, adjust=None):
        adjusted = adjust.apply(logits).cpu() if adjust is not None else None
        calls.append(SampledStep(info.seeds.tolist(), steps.tolist(), logits.cpu(), adjusted))
        return sample(logits, info, steps, adjust)

    monkeypatch.setattr(scheduler, "draw_tokens", recorded)
    return calls


def check_against_reference(
    calls: list[SampledStep], reqs: list[Req], eos_ids: Iterable[int]
) -> dict[str, int]:
    """Assert that every recorded row's adjusted logits equal `reference_logits` of its request
    (found by its seed) at its step, bit for bit, and that greedy rows picked the argmax of the
    adjusted logits; returns how many rows of each request were checked."""
    by_seed = {r.seed: r for r in reqs}
    assert len(by_seed) == len(reqs), "the requests need distinct seeds"
    checked = {r.rid: 0 for r in reqs}
    for call in calls:
        for i, (seed, step) in enumerate(zip(call.seeds, call.steps, strict=True)):
            req = by_seed[seed]
            params = req.sampling_params
            got = call.adjusted[i] if call.adjusted is not None else call.raw[i]
            want = reference_logits(
                call.raw[i], req.input_ids, req.output_ids[:step], params, eos_ids
            )
            assert torch.equal(got, want), (req.rid, step, (got - want).abs().max())
            if params.is_greedy and step < len(req.output_ids):
                assert req.output_ids[step] == int(got.argmax()), (req.rid, step)
            checked[req.rid] += 1
    return checked
