"""What speculative decoding reports: the counts behind /metrics and a response's meta_info."""

from __future__ import annotations

from dataclasses import dataclass, field


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
