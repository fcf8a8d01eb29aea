"""Batched token sampling with per-request counter-based randomness.

A request's sampled token is a pure function of (its logits row, its SamplingParams, its seed,
its step): the noise comes from an integer hash of (seed, step, vocab index), not from torch's
global RNG, so the result does not depend on batch position, batch companions or device.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from replaylm.distributed.communication import broadcast_from_rank0
from replaylm.layers.kernels import use_triton_kernels
from replaylm.layers.sampling_hash import GOLDEN, MIX1, MIX2, UNIFORM_BITS
from replaylm.sampling_params import SamplingParams


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 `x` by `n` (torch's `>>` is arithmetic on signed ints)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors: a bijective avalanche mix of 64 bits."""
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def seeded_uniform(
    seeds: torch.Tensor, steps: torch.Tensor, vocab_ids: torch.Tensor
) -> torch.Tensor:
    """Uniform floats in the open interval (0, 1), a pure function of (seed, step, vocab id).

    `seeds` and `steps` are int64 [B]; `vocab_ids` is int64 [V] or [B, V]. Returns float32
    [B, V]. Only integer ops are used, so values are bit-identical on every device.
    """
    row = _mix64(_mix64(seeds) + steps * GOLDEN).unsqueeze(1)
    bits = _shr(_mix64(row + (vocab_ids + 1) * GOLDEN), 64 - UNIFORM_BITS)
    return (bits.to(torch.float32) + 0.5) * (2.0**-UNIFORM_BITS)


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling tensors, all on one device, plus flags computed once at build time.

    temperatures: float32 [B], 0.0 marks a greedy row (temperature 0 or top_k 1).
    top_ps: float32 [B]; top_ks: int64 [B], vocab size where top-k is off; min_ps: float32 [B];
    seeds: int64 [B]. The flags only consider sampled (non-greedy) rows: `all_greedy` means no
    row samples, `need_top_p_top_k` / `need_min_p` mean some sampled row filters that way.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    all_greedy: bool
    need_top_p_top_k: bool
    need_min_p: bool

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatchInfo:
        """Build from validated params and one resolved seed (int in [0, 2**63)) per request.
        The tensors cross to `device` in one asynchronous copy (a copy from a Python list
        straight to CUDA would wait for the work queued on the stream)."""
        n = len(params)
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} requests")
        sampled = [p for p in params if not p.is_greedy]
        # packed by the array module (a C loop; torch.tensor of a list costs far more per
        # element), int64 first for alignment, then sent in one copy
        ints = array(
            "q", [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        )
        ints.extend(seeds)
        floats = array("f", [0.0 if p.is_greedy else p.temperature for p in params])
        floats.extend(p.top_p for p in params)
        floats.extend(p.min_p for p in params)
        host = bytearray(ints) + bytearray(floats)
        packed = (
            torch.frombuffer(host, dtype=torch.uint8) if host else torch.empty(0, dtype=torch.uint8)
        ).to(device, non_blocking=True)
        wide, narrow = packed.split_with_sizes([16 * n, 12 * n])
        top_ks, seeds_t = wide.view(torch.int64).split_with_sizes([n, n])
        temperatures, top_ps, min_ps = narrow.view(torch.float32).split_with_sizes([n, n, n])
        return cls(
            temperatures=temperatures,
            top_ps=top_ps,
            min_ps=min_ps,
            top_ks=top_ks,
            seeds=seeds_t,
            all_greedy=not sampled,
            need_top_p_top_k=any(p.top_p < 1 or 0 < p.top_k < vocab_size for p in sampled),
            need_min_p=any(p.min_p > 0 for p in sampled),
        )


class Sampler(torch.nn.Module):
    """Pick one token per row: argmax for greedy rows, filtered seeded sampling for the rest."""

    def forward(
        self, logits: torch.Tensor, info: SamplingBatchInfo, steps: torch.Tensor
    ) -> torch.Tensor:
        """Sample from float32 `logits` [B, V]; `steps` int64 [B] is each row's output index.

        Sampled rows take the Gumbel-max draw argmax(logits / temperature - log(E)) over the
        tokens their filters keep (top-k, then top-p on the top-k-renormalised distribution,
        then min-p relative to the top probability), E = -log(U) and U = seeded_uniform(seed,
        step, vocab id): a draw from softmax(logits / temperature) renormalised over those
        tokens. Returns int64 [B]. No host sync beyond the flags in `info`.
        """
        if info.all_greedy:
            return logits.argmax(dim=-1)
        filtered = info.need_top_p_top_k or info.need_min_p
        if not filtered and use_triton_kernels(logits):  # one pass over the logits
            from replaylm.layers.kernels.seeded_sample import seeded_sample

            return seeded_sample(logits, info.temperatures, info.seeds, steps)
        greedy = info.temperatures == 0
        scaled = logits / torch.where(greedy, 1.0, info.temperatures).unsqueeze(1)
        vocab_ids = torch.arange(logits.shape[-1], device=logits.device)
        scores = scaled - torch.log(-torch.log(seeded_uniform(info.seeds, steps, vocab_ids)))
        if filtered:
            scores = scores.masked_fill(~_kept(scaled, info), float("-inf"))
        return torch.where(greedy, logits.argmax(dim=-1), scores.argmax(dim=-1))


class RankZeroSampler(Sampler):
    """The sampler of a tensor-parallel rank: every rank samples from its (gathered) logits,
    then takes rank 0's ids, so ranks whose logits differ in the last bit never drift apart."""

    def forward(
        self, logits: torch.Tensor, info: SamplingBatchInfo, steps: torch.Tensor
    ) -> torch.Tensor:
        return broadcast_from_rank0(super().forward(logits, info, steps))


def _kept(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """bool [B, V]: the tokens each row's top-k, top-p and min-p keep, from its logits divided
    by its temperature (`scaled`)."""
    probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
    kept = _filter_sorted(probs, info) > 0
    return torch.empty_like(kept).scatter_(1, order, kept)


def _filter_sorted(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the filtered-out entries of descending-sorted `probs` [B, V]; the top one survives.

    top-p keeps the smallest prefix whose mass reaches top_p of the top-k mass (rows with
    top_p == 1 are left alone, so float rounding of the cumsum cannot drop tail tokens).
    """
    if info.need_top_p_top_k:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        probs = probs.masked_fill(ranks >= info.top_ks.unsqueeze(1), 0.0)
        cum = probs.cumsum(dim=-1)
        before = cum - probs  # mass strictly above each token; exactly 0 for the top one
        drop = (before >= info.top_ps.unsqueeze(1) * cum[:, -1:]) & (info.top_ps < 1).unsqueeze(1)
        probs = probs.masked_fill(drop, 0.0)
    if info.need_min_p:
        probs = probs.masked_fill(probs < info.min_ps.unsqueeze(1) * probs[:, :1], 0.0)
    return probs
