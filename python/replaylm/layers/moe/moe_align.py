"""The token-to-expert sort of the fused MoE kernels, block-aligned, on the device.

The T x k routed (token, slot) pairs are numbered `token * k + slot`. Sorted by expert, each
expert's run padded with a sentinel (T * k) to a multiple of `block_m`, they let the grouped GEMM
give each program one expert's `block_m` rows. A decode step's pairs (up to `_ONE_LAUNCH_PAIRS`)
take one launch of one program per expert, each counting them all (a histogram) and placing
its own. More pairs take three launches, each linear in the pairs: a histogram per chunk of
`_CHUNK` pairs; one program per expert, which lays out its run and where each chunk's pairs of it
start; one program per chunk, which writes each of its pairs there, after those of the chunk's
earlier pairs with the same expert. No host sync, buffer sizes fixed by T, k, E and `block_m`:
CUDA graphs capture it. Ids outside 0..E-1 (experts of other ranks) belong to no run, so their
pairs are left out. Within an expert the pairs keep their order: the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers

# up to this many pairs (a decode step's of up to 256 tokens, top 8) every program of the place
# kernel counts them all: one launch, not three and the totals' zeroing
_ONE_LAUNCH_PAIRS = 2048
# pairs per program of the histogram and scatter kernels (the scatter ranks them pairwise)
_CHUNK = 128
_CHUNK_TILE = 1024  # chunks the place kernel reads at a time


@triton.jit
def _bins(Ids, start, numel, num_experts, SIZE: tl.constexpr):
    """The `SIZE` ids from `start`, those outside 0..num_experts-1 or past `numel` as
    num_experts (a bin of no expert)."""
    offs = start + tl.arange(0, SIZE)
    ids = tl.load(Ids + offs, mask=offs < numel, other=-1)
    return tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)


@triton.jit(do_not_specialize=["numel"])
def _histogram_kernel(
    Ids,
    Hist,
    Totals,
    numel,
    num_experts,
    CHUNK: tl.constexpr,
    BINS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Hist[c, e] = how many of chunk c's ids equal e, for this program's chunk c, added to
    Totals[e] (zeroed before)."""
    wait_for_producers(USE_PDL)
    chunk = tl.program_id(0)
    ids = _bins(Ids, chunk * CHUNK, numel, num_experts, CHUNK)
    bins = tl.arange(0, BINS)
    hist = tl.histogram(ids, BINS)
    tl.store(Hist + chunk * BINS + bins, hist)
    tl.atomic_add(Totals + bins, hist, mask=hist > 0)


@triton.jit(do_not_specialize=["numel", "num_chunks"])
def _place_kernel(
    Ids,
    Hist,
    Totals,
    Base,
    SortedIds,
    ExpertIds,
    NumPostPad,
    numel,
    num_experts,
    num_chunks,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    SCAN: tl.constexpr,
    CHUNKS: tl.constexpr,
    COUNT_ALL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """This program's expert's run: from its start (the padded runs of the experts before it),
    the sentinel after its pairs up to the run's padded end, its id for each of the run's
    blocks; program 0 also writes the padded total. With `COUNT_ALL` (every id within one SCAN)
    it counts every expert's pairs itself and writes its own in order; else it reads the
    experts' totals and its column of the chunks' histograms and writes, per chunk c,
    Base[c, expert]: where the chunk's pairs of this expert start, `CHUNKS` chunks at a time
    (one variant for any number of pairs, so the prefill graphs' capture compiles what a longer
    eager chunk runs)."""
    wait_for_producers(USE_PDL)
    expert = tl.program_id(0)
    e = tl.arange(0, BINS)
    if COUNT_ALL:
        ids = _bins(Ids, 0, numel, num_experts, SCAN)
        counts = tl.histogram(ids, BINS)
    else:
        counts = tl.load(Totals + e)
    counts = tl.where(e < num_experts, counts, 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    if expert == 0:
        tl.store(NumPostPad, tl.sum(padded, axis=0))
    run_start = tl.sum(tl.where(e < expert, padded, 0), axis=0)
    count = tl.sum(tl.where(e == expert, counts, 0), axis=0)
    run_end = run_start + tl.sum(tl.where(e == expert, padded, 0), axis=0)
    pad = run_start + count + tl.arange(0, BLOCK_M)
    tl.store(SortedIds + pad, numel + tl.zeros((BLOCK_M,), tl.int32), mask=pad < run_end)
    for block in range(run_start // BLOCK_M, run_end // BLOCK_M, SCAN):
        blocks = block + tl.arange(0, SCAN)
        mine = expert + tl.zeros((SCAN,), tl.int32)
        tl.store(ExpertIds + blocks, mine, mask=blocks < run_end // BLOCK_M)
    if COUNT_ALL:
        hit = (ids == expert).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit
        tl.store(SortedIds + run_start + rank, tl.arange(0, SCAN), mask=hit > 0)
    else:
        before = run_start  # this expert's pairs in the chunks before the tile
        for first in range(0, num_chunks, CHUNKS):
            c = first + tl.arange(0, CHUNKS)
            column = tl.load(Hist + c * BINS + expert, mask=c < num_chunks, other=0)
            base = before + tl.cumsum(column, axis=0) - column
            tl.store(Base + c * BINS + expert, base, mask=c < num_chunks)
            before += tl.sum(column, axis=0)


@triton.jit(do_not_specialize=["numel"])
def _scatter_kernel(
    Ids,
    Base,
    SortedIds,
    numel,
    num_experts,
    CHUNK: tl.constexpr,
    BINS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """This program's chunk's pairs, each written to its place: Base[chunk, expert] plus how
    many of the chunk's pairs before it have its expert."""
    wait_for_producers(USE_PDL)
    chunk = tl.program_id(0)
    index = tl.arange(0, CHUNK)
    ids = _bins(Ids, chunk * CHUNK, numel, num_experts, CHUNK)
    earlier = (ids[:, None] == ids[None, :]) & (index[None, :] < index[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    kept = ids < num_experts
    base = tl.load(Base + chunk * BINS + ids, mask=kept, other=0)
    tl.store(SortedIds + base + rank, chunk * CHUNK + index, mask=kept)


def max_padded_rows(numel: int, num_experts: int, block_m: int) -> int:
    """The most sorted rows `numel` pairs can take: each expert that has any pads its run by at
    most `block_m - 1`, and at most min(E, numel) have any; rounded up to whole blocks."""
    bound = numel + min(num_experts, numel) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk_tile: int = _CHUNK_TILE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids `[R]`, expert_ids `[R / block_m]`, num_tokens_post_padded `[1]`), int32, for
    `topk_ids` `[T, k]` and R = `max_padded_rows(T * k, E, block_m)`: the pair numbers
    (`token * k + slot`) of each expert 0..E-1 in turn, each run padded with T * k to a multiple
    of `block_m`; the expert of each block; the padded total. Entries past the total are
    unspecified (the GEMM's programs there exit). `chunk_tile`: the chunks of `_CHUNK` pairs
    the place kernel reads at a time (a power of two)."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    numel = ids.numel()
    rows = max_padded_rows(numel, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts + 1)  # a bin past the experts: other ranks' ids
    count_all = numel <= _ONE_LAUNCH_PAIRS
    chunks = 0 if count_all else triton.cdiv(numel, _CHUNK)
    hist = torch.empty((chunks, bins), dtype=torch.int32, device=device)
    base = torch.empty((chunks, bins), dtype=torch.int32, device=device)
    totals = torch.zeros(0 if count_all else bins, dtype=torch.int32, device=device)
    if not count_all:
        _histogram_kernel[(chunks,)](
            ids, hist, totals, numel, num_experts, CHUNK=_CHUNK, BINS=bins, **pdl_launch()
        )
    _place_kernel[(num_experts,)](
        ids,
        hist,
        totals,
        base,
        sorted_ids,
        expert_ids,
        num_post_pad,
        numel,
        num_experts,
        chunks,
        BLOCK_M=block_m,
        BINS=bins,
        SCAN=triton.next_power_of_2(max(numel, 16)) if count_all else 1024,
        CHUNKS=chunk_tile,
        COUNT_ALL=count_all,
        **pdl_launch(),
    )
    if not count_all:
        _scatter_kernel[(chunks,)](
            ids, base, sorted_ids, numel, num_experts, CHUNK=_CHUNK, BINS=bins, **pdl_launch()
        )
    return sorted_ids, expert_ids, num_post_pad
