"""The drafter interface, the acceptance rule and a scheduler's speculation settings."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from replaylm.speculative.stats import SpeculationStats


class DraftTarget(Protocol):
    """What a drafter reads of a request (the scheduler's `Req`): its tokens so far (prompt
    and output, read in slices: a whole copy per step would cost the context's length), its
    row of the target's KV table, and a slot for the drafter's own state."""

    draft_state: object | None
    req_pool_idx: int | None  # its row of the target's request-to-slot table

    @property
    def num_ids(self) -> int: ...

    def id_slice(self, start: int, end: int) -> list[int]: ...


class Drafter(ABC):
    """Proposes draft tokens for running requests; the target model verifies them."""

    name: str
    # whether every tensor-parallel rank proposes the same tokens (decided on the host from the
    # requests' tokens); a model's argmax may differ in the last bit, so ranks take rank 0's
    same_on_every_rank = True

    @abstractmethod
    def propose(self, reqs: Sequence[DraftTarget], limits: Sequence[int]) -> list[list[int]]:
        """Up to `limits[i]` tokens continuing request i's tokens; fewer, or
        none, where it has no guess."""

    def accepted(self, reqs: Sequence[DraftTarget], counts: Sequence[int]) -> None:  # noqa: B027
        """How many of each request's last proposal the target accepted (a drafter with a KV
        cache of its own gives back the rest here); nothing by default."""

    def release(self, req: DraftTarget) -> None:  # noqa: B027
        """Forget a request that left the running set (finished, aborted or retracted): free
        what the drafter holds for it; nothing by default."""


def accept_matching(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's choices: `targets[i]` is the target's token
    after the request's tokens and `drafts[:i]` (so `targets` has one more entry)."""
    accepted = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted


@dataclass
class Speculation:
    """A scheduler's speculative decoding: its drafter, the drafts per request per verify step
    (`num_steps`), the largest batch that speculates (`max_bs`, None: any; a larger one decodes
    plainly) and its counts."""

    drafter: Drafter
    num_steps: int
    max_bs: int | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)
