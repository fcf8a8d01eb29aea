"""SamplingParams: the per-request decoding knobs, as accepted from an API request."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

_MAX_SEED = 2**63 - 1


def _is_int(x: object) -> bool:
    """True for a real int (bool excluded, since JSON `true` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """True for an int or float (bool excluded); NaN fails the range checks that follow."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Decoding settings for one request.

    `top_k == -1` turns top-k off; `temperature == 0` (or `top_k == 1`) means greedy decoding.
    `seed` of None lets the server draw one. `stop` accepts a single string, wrapped into a list.
    Construction does not validate; call `validate()` (or build through `from_dict`).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Normalise the list fields; anything else is left for validate() to reject.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax: temperature 0 or top_k 1."""
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError (one line naming the field and its allowed range) on a bad value."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build and validate from a request dict; unknown keys raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        params = cls(**d)
        params.validate()
        return params
