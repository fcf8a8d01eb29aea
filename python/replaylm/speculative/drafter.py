"""The drafter interface, which requests speculate, and the counts /metrics reports."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replaylm.runtime.request import Req


class Drafter(ABC):
    """Proposes draft tokens for running requests; the target model verifies them."""

    name: str

    @abstractmethod
    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        """Up to `limits[i]` tokens continuing request i's tokens (`Req.all_ids`); fewer, or
        none, where it has no guess."""

    def accepted(self, reqs: Sequence[Req], counts: Sequence[int]) -> None:  # noqa: B027
        """How many of each request's last proposal the target accepted (a drafter with a KV
        cache of its own gives back the rest here); nothing by default."""


def speculates(req: Req) -> bool:
    """Whether a request's drafts can be checked by comparing tokens: greedy, with no logit
    adjustments (penalties, logit_bias, min_tokens), no grammar and no logprobs. The others
    decode one token per step inside the verify batch."""
    params = req.sampling_params
    return (
        params.is_greedy
        and req.grammar is None
        and req.top_logprobs is None
        and not params.logit_bias
        and not params.has_penalties
        and len(req.output_ids) >= params.min_tokens
    )


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's choices: `targets[i]` is the target's token
    after the request's tokens and `drafts[:i]` (so `targets` has one more entry)."""
    accepted = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted


@dataclass
class SpeculationStats:
    """Counts over request verifications (a request's part of a verify step, with drafts):
    tokens drafted and accepted, per-position acceptance, and how many verifications accepted
    each number of drafts (index: drafts accepted)."""

    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)  # drafts proposed at position i
    accepted_at: list[int] = field(default_factory=list)  # of them, accepted
    accept_lengths: list[int] = field(default_factory=list)  # verifications per drafts accepted
    verify_steps: int = 0
    draft_seconds: float = 0.0  # the drafter's proposals, host time
    verify_seconds: float = 0.0  # verify steps: batch, forward, acceptance (the GPU waited for)

    def record(self, drafts: int, accepted: int) -> None:
        """One request's part of a verify step that proposed it `drafts` tokens."""
        self.verifies += 1
        self.drafted += drafts
        self.accepted += accepted
        for counts, n in (
            (self.proposed_at, drafts),
            (self.accepted_at, accepted),
            (self.accept_lengths, accepted + 1),
        ):
            counts.extend([0] * (n - len(counts)))
        for i in range(drafts):
            self.proposed_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.accept_lengths[accepted] += 1

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per request per verify step."""
        return self.accepted / self.verifies if self.verifies else 0.0


def spec_meta_info(verify_ct: int, accepted: int) -> dict[str, int | float]:
    """A response's `meta_info` entries on speculative decoding (SGLang's names): verify steps
    and tokens gained per verify step; nothing for a request that never took part in one."""
    if not verify_ct:
        return {}
    return {
        "spec_verify_ct": verify_ct,
        "spec_accepted_drafts": accepted,
        "spec_accept_length": round((verify_ct + accepted) / verify_ct, 3),
    }


@dataclass
class Speculation:
    """A scheduler's speculative decoding: its drafter, the drafts per request per verify step
    (`num_steps`), the largest batch that speculates (`max_bs`, None: any; a larger one decodes
    plainly) and its counts."""

    drafter: Drafter
    num_steps: int
    max_bs: int | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)
