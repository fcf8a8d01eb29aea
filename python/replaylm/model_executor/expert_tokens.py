"""Reading a mixture-of-experts model's token counters (`FusedMoE.routed_tokens`, kept on the
device by every MoE layer) for the scheduler's stats, without waiting on the device.

A read that waited would stall the host until the queued steps finish, each time. So on a GPU
the counters are summed over the layers and copied into pinned host memory behind the queued
work, at most every REFRESH_S; a later read takes that copy once its event has passed, and until
then the previous totals. The published totals thus lag the device by up to about REFRESH_S
while the server is busy (the last steps before it idles show with its next step), which a
Prometheus scrape interval dwarfs. On the CPU the device is the host: every read is current.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from replaylm.layers.moe.layer import FusedMoE
from replaylm.model_executor.forward_stats import ExpertTokens

REFRESH_S = 1.0


class ExpertTokenReader:
    """The totals of `layers`' counters (`ExpertTokens`), with each expert-parallel rank's sum
    when the layers' experts are split over ranks."""

    def __init__(self, layers: list[FusedMoE]) -> None:
        first = layers[0]
        self.counters = [layer.routed_tokens for layer in layers]
        self.per_rank = first.local_experts.size
        self.ranks = first.num_experts // self.per_rank
        on_gpu = first.routed_tokens.device.type == "cuda"
        self.host = torch.zeros(first.num_experts, dtype=torch.int64, pin_memory=on_gpu)
        self.copied = torch.cuda.Event() if on_gpu else None
        self.interval = REFRESH_S if on_gpu else 0.0
        self.in_flight = False
        self.next_copy = 0.0
        self.latest = self._totals()

    @classmethod
    def of(cls, model: nn.Module) -> ExpertTokenReader | None:
        """The reader of `model`'s MoE layers; None for a dense model."""
        layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        return cls(layers) if layers else None

    def read(self) -> ExpertTokens:
        """The latest totals that reached the host; starts the next copy when none is in
        flight and REFRESH_S has passed (on the CPU: every read, done at once)."""
        if self.in_flight and self.copied is not None and self.copied.query():
            self.in_flight = False
            self.latest = self._totals()
        now = time.monotonic()
        if not self.in_flight and now >= self.next_copy:
            self.next_copy = now + self.interval
            self.host.copy_(torch.stack(self.counters).sum(0), non_blocking=True)
            if self.copied is None:
                self.latest = self._totals()
            else:
                self.copied.record()
                self.in_flight = True
        return self.latest

    def _totals(self) -> ExpertTokens:
        """`host`'s counts, and each rank's sum under expert parallelism."""
        experts = self.host.tolist()
        if self.ranks == 1:
            return ExpertTokens(experts)
        n = self.per_rank
        return ExpertTokens(experts, [sum(experts[r * n : (r + 1) * n]) for r in range(self.ranks)])
