"""The n-gram drafter (prompt lookup): proposes what followed the latest earlier occurrence of a
request's last few tokens in its own prompt and output. No model; costs a dictionary lookup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from replaylm.speculative.drafter import Drafter, DraftTarget


@dataclass
class NgramIndex:
    """A request's n-grams: each one's end (the index of the token after it) at its latest
    occurrence that has a following token. Grown as the request's tokens grow, never rebuilt."""

    indexed: int = 0  # n-grams ending before this index are in `ends`
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)

    def update(self, req: DraftTarget, sizes: range) -> None:
        """Index the n-grams ending at the request's tokens not indexed yet (reading only those
        and the `sizes.stop - 1` before them)."""
        total = req.num_ids
        first = max(self.indexed, 1)
        if first >= total:
            return
        offset = max(first - (sizes.stop - 1), 0)
        ids = req.id_slice(offset, total)
        for end in range(first, total):
            for n in sizes:
                if n <= end:
                    self.ends[tuple(ids[end - n - offset : end - offset])] = end
        self.indexed = total


class NgramDrafter(Drafter):
    """Matches the request's last `max_window` .. `min_window` tokens (longest first) against
    its earlier tokens and proposes the tokens that followed the latest match."""

    name = "ngram"

    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(
                f"n-gram windows must satisfy 1 <= min <= max, got {min_window}, {max_window}"
            )
        self.sizes = range(min_window, max_window + 1)

    def propose(self, reqs: Sequence[DraftTarget], limits: Sequence[int]) -> list[list[int]]:
        return [
            self._propose(req, limit) if limit > 0 else []
            for req, limit in zip(reqs, limits, strict=True)
        ]

    def _propose(self, req: DraftTarget, limit: int) -> list[int]:
        if not isinstance(req.draft_state, NgramIndex):
            req.draft_state = NgramIndex()
        index: NgramIndex = req.draft_state
        index.update(req, self.sizes)
        total = req.num_ids
        tail = req.id_slice(max(total - self.sizes.stop + 1, 0), total)
        for n in reversed(self.sizes):
            if n > len(tail):
                continue
            end = index.ends.get(tuple(tail[len(tail) - n :]))
            if end is not None:
                return req.id_slice(end, min(end + limit, total))
        return []
