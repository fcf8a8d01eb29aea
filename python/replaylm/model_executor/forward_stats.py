"""Counts of forward passes per phase (served by graph replay or eager, and padding computed),
and of a mixture-of-experts model's tokens per expert."""

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


@dataclass
class ExpertTokens:
    """A mixture-of-experts model's routed tokens so far, summed over its MoE layers (a token
    counts once per layer, for each expert that layer sends it to; a CUDA graph's padding rows
    not at all): `experts[e]`, expert e's; `ranks[r]`, under expert parallelism, those of the
    experts rank r holds (None without)."""

    experts: list[int]
    ranks: list[int] | None = None
