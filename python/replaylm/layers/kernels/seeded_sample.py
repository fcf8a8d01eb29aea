"""The sampler's unfiltered draw in one pass over the logits: per row, argmax(logits) where its
temperature is 0, else the Gumbel-max draw argmax(logits / T - log(-log U)), U the noise of
`layers/sampler.py`'s `seeded_uniform` (the same splitmix64 hash on unsigned 64-bit integers,
which wrap as torch's signed ones do, and the same exact 23-bit float conversion), computed in
place and never stored.

Bit-equal to the sampler's torch code on CUDA: the division is correctly rounded (`div_rn`), the
logarithm is libdevice's, as torch's CUDA ops compute them, and ties go to the lowest vocabulary
id, as torch.argmax's do. The torch code reads and writes `[B, V]` float32 tensors several times
(noise, two logarithms, quotient, difference, two argmaxes), each a launch; this reads the logits
once in two launches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from replaylm.layers import sampling_hash

BLOCK = 4096  # vocabulary ids per program: Qwen3's 151,936 in 38 blocks
# Triton's interpreter (the CPU tests) has no libdevice; there tl.log is NumPy's
_LIBDEVICE = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
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
def _log(x):
    """The natural logarithm as torch's CUDA ops compute it (tl.log approximates it)."""
    if _LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


# the per-row parameters come from the sampling batch's packed buffer, where the seeds' offset
# follows the batch size: no variant per alignment, so no compile inside a running server
@triton.jit(do_not_specialize_on_alignment=["Temperatures", "Seeds", "Steps"])
def _block_argmax_kernel(
    Logits,
    Temperatures,
    Seeds,
    Steps,
    BlockMax,
    BlockArg,
    vocab,
    stride_l,
    num_blocks,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
):
    """Grid `(B, num_blocks)`: the best score of one block of a row's ids, and its id."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(Logits + row.to(tl.int64) * stride_l + cols, mask=ok, other=float("-inf"))
    temperature = tl.load(Temperatures + row)
    if temperature == 0.0:
        score = x
    else:
        golden = tl.full((), _GOLDEN, tl.uint64)
        seed = tl.load(Seeds + row).to(tl.uint64, bitcast=True)
        step = tl.load(Steps + row).to(tl.uint64, bitcast=True)
        mixed = _mix64(_mix64(seed) + step * golden)
        bits = _mix64(mixed + (cols.to(tl.uint64) + 1) * golden) >> (64 - BITS)
        uniform = (bits.to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
        score = tl.math.div_rn(x, temperature) - _log(-_log(uniform))
        score = tl.where(ok, score, float("-inf"))
    best, arg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(BlockMax + row * num_blocks + block, best)
    tl.store(BlockArg + row * num_blocks + block, block * BLOCK + arg)


@triton.jit
def _row_argmax_kernel(BlockMax, BlockArg, Out, num_blocks, BLOCKS_P2: tl.constexpr):
    """Grid `(B,)`: the row's id, from its blocks' bests (the first block on a tie)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCKS_P2)
    best = tl.load(BlockMax + row * num_blocks + offs, mask=offs < num_blocks, other=float("-inf"))
    which = tl.argmax(best, axis=0, tie_break_left=True)
    tl.store(Out + row, tl.load(BlockArg + row * num_blocks + which).to(tl.int64))


def seeded_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    block: int = BLOCK,
) -> torch.Tensor:
    """int64 `[B]`: each row's token of float32 `logits` `[B, V]`: the argmax where
    `temperatures` (float32 `[B]`) is 0, else the Gumbel-max draw at that temperature with the
    noise of int64 `seeds` and `steps` `[B]` (all three contiguous, on the logits' device)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_blocks = triton.cdiv(vocab, block)
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    block_arg = torch.empty(rows, num_blocks, dtype=torch.int32, device=logits.device)
    _block_argmax_kernel[(rows, num_blocks)](
        logits,
        temperatures,
        seeds,
        steps,
        block_max,
        block_arg,
        vocab,
        logits.stride(0),
        num_blocks,
        BLOCK=block,
        BITS=sampling_hash.UNIFORM_BITS,
        num_warps=8,
    )
    _row_argmax_kernel[(rows,)](
        block_max, block_arg, out, num_blocks, BLOCKS_P2=triton.next_power_of_2(num_blocks)
    )
    return out
