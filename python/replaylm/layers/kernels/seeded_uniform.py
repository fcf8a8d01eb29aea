"""The sampler's noise in one launch: `seeded_uniform(seeds, steps, arange(vocab))` of
`layers/sampler.py`, bit-equal to its torch code (the same splitmix64 hash on unsigned 64-bit
integers, which wrap as torch's signed ones do, then an exact 23-bit float conversion). The torch
code is dozens of small ops, each a launch: host time a decode step waits through."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers import sampling_hash

# the torch code's constants (signed int64 there) as the unsigned values the kernel computes with
_GOLDEN = tl.constexpr(sampling_hash.GOLDEN % 2**64)
_MIX1 = tl.constexpr(sampling_hash.MIX1 % 2**64)
_MIX2 = tl.constexpr(sampling_hash.MIX2 % 2**64)


@triton.jit
def _mix64(x):
    """splitmix64's finalizer on uint64."""
    x = (x ^ (x >> 30)) * tl.full((), _MIX1, tl.uint64)
    x = (x ^ (x >> 27)) * tl.full((), _MIX2, tl.uint64)
    return x ^ (x >> 31)


@triton.jit
def _seeded_uniform_kernel(Seeds, Steps, Out, vocab, BLOCK: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    golden = tl.full((), _GOLDEN, tl.uint64)
    seed = tl.load(Seeds + row).to(tl.uint64, bitcast=True)
    step = tl.load(Steps + row).to(tl.uint64, bitcast=True)
    mixed = _mix64(_mix64(seed) + step * golden)
    bits = _mix64(mixed + (cols.to(tl.uint64) + 1) * golden) >> (64 - BITS)
    uniform = (bits.to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
    tl.store(Out + row.to(tl.int64) * vocab + cols, uniform, mask=cols < vocab)


def seeded_uniform_vocab(
    seeds: torch.Tensor, steps: torch.Tensor, vocab: int, block: int = 2048
) -> torch.Tensor:
    """float32 `[B, vocab]`: the sampler's uniform noise of every vocabulary id in order, for
    int64 `seeds` and `steps` `[B]` (contiguous, on the kernel's device)."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _seeded_uniform_kernel[(seeds.shape[0], triton.cdiv(vocab, block))](
            seeds,
            steps,
            out,
            vocab,
            BLOCK=block,
            BITS=sampling_hash.UNIFORM_BITS,
            num_warps=4,
        )
    return out
