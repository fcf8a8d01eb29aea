"""Counts of forward passes per phase: served by graph replay or eager, and padding computed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PhaseCounts:
    graph: int = 0
    eager: int = 0
    padding_tokens: int = 0


@dataclass
class ForwardStats:
    phases: dict[str, PhaseCounts] = field(
        default_factory=lambda: {
            "decode": PhaseCounts(),
            "prefill": PhaseCounts(),
            "verify": PhaseCounts(),
        }
    )

    def record(self, phase: str, graph: bool, padding_tokens: int) -> None:
        counts = self.phases[phase]
        if graph:
            counts.graph += 1
        else:
            counts.eager += 1
        counts.padding_tokens += padding_tokens
