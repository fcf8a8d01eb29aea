"""The sampler's draw over the vocabulary in order, `argmax(probs / -log(u))` with
`u = seeded_uniform(seeds, steps, arange(vocab))` of `layers/sampler.py`, in one launch (and a
small argmax over its per-block maxima). The noise is bit-equal to the torch code's (the same
splitmix64 hash on unsigned 64-bit integers, which wrap as torch's signed ones do, then an exact
23-bit float conversion), the division is rounded to nearest as torch's, and ties go to the
first index, so the pick is torch's. The torch code takes ~45 ops, each a launch and a pass over
`[B, vocab]` floats: host time a decode step waits through, and ~1 GB of traffic at 256 rows of
Qwen3's vocabulary."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers import sampler

# the torch code's constants (signed int64 there) as the unsigned values the kernel computes with
_GOLDEN = tl.constexpr(sampler._GOLDEN % 2**64)
_MIX1 = tl.constexpr(sampler._MIX1 % 2**64)
_MIX2 = tl.constexpr(sampler._MIX2 % 2**64)


@triton.jit
def _mix64(x):
    """splitmix64's finalizer on uint64."""
    x = (x ^ (x >> 30)) * tl.full((), _MIX1, tl.uint64)
    x = (x ^ (x >> 27)) * tl.full((), _MIX2, tl.uint64)
    return x ^ (x >> 31)


@triton.jit
def _uniform(Seeds, Steps, row, cols, BITS: tl.constexpr):
    """The noise of vocabulary ids `cols` for request `row`."""
    golden = tl.full((), _GOLDEN, tl.uint64)
    seed = tl.load(Seeds + row).to(tl.uint64, bitcast=True)
    step = tl.load(Steps + row).to(tl.uint64, bitcast=True)
    mixed = _mix64(_mix64(seed) + step * golden)
    bits = _mix64(mixed + (cols.to(tl.uint64) + 1) * golden) >> (64 - BITS)
    return (bits.to(tl.float32) + 0.5) * (1.0 / (1 << BITS))


@triton.jit
def _noisy_argmax_kernel(Probs, Seeds, Steps, BestVal, BestIdx, vocab, stride_p,
                         BLOCK: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    probs = tl.load(Probs + row.to(tl.int64) * stride_p + cols, mask=inside, other=0.0)
    noise = -tl.log(_uniform(Seeds, Steps, row, cols, BITS))
    score = tl.where(inside, tl.math.div_rn(probs, noise), -1.0)
    best, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = row * tl.num_programs(1) + block
    tl.store(BestVal + out, best)
    tl.store(BestIdx + out, block * BLOCK + at)


def noisy_argmax(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                 block: int = 2048) -> torch.Tensor:
    """int64 `[B]`: `argmax(probs / -log(seeded_uniform(seeds, steps, arange(V))))` per row of
    float32 `probs` `[B, V]` (unit column stride), the sampler's choice over the vocabulary in
    order; per-block maxima, then torch's argmax over them (first index on ties)."""
    rows, vocab = probs.shape
    blocks = triton.cdiv(vocab, block)
    best = torch.empty(rows, blocks, dtype=torch.float32, device=probs.device)
    at = torch.empty(rows, blocks, dtype=torch.int32, device=probs.device)
    if rows:
        _noisy_argmax_kernel[(rows, blocks)](
            probs, seeds, steps, best, at, vocab, probs.stride(0), BLOCK=block,
            BITS=sampler._UNIFORM_BITS, num_warps=4,
        )
    return at.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()
