"""The token-to-expert sort of the fused MoE kernels, block-aligned, on the device.

The T x k routed (token, slot) pairs are numbered `token * k + slot`. Sorted by expert, each
expert's run padded with a sentinel (T * k) to a multiple of `block_m`, they let the grouped GEMM
give each program one expert's `block_m` rows. Two launches of one program per expert (count,
then place; one for a decode step's few pairs, each program counting them all), no host sync,
buffer sizes fixed by T, k, E and `block_m`: CUDA graphs capture it.
Ids outside 0..E-1 (experts of other ranks) belong to no program, so their pairs are left out.
Within an expert the pairs keep their order: the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers

_SCAN = 1024  # ids a program reads per step
# up to this many pairs every program of the place kernel counts them all: one launch, not two
_ONE_LAUNCH_PAIRS = 256


@triton.jit(do_not_specialize=["numel"])
def _count_kernel(Ids, Counts, numel, SCAN: tl.constexpr, USE_PDL: tl.constexpr):
    """Counts[e] = how many of the `numel` ids equal e, for e = this program."""
    wait_for_producers(USE_PDL)
    expert = tl.program_id(0)
    hits = tl.zeros((SCAN,), tl.int32)
    for start in range(0, numel, SCAN):
        offs = start + tl.arange(0, SCAN)
        ids = tl.load(Ids + offs, mask=offs < numel, other=-1)
        hits += (ids == expert).to(tl.int32)
    tl.store(Counts + expert, tl.sum(hits, axis=0))


@triton.jit(do_not_specialize=["numel"])
def _place_kernel(
    Ids,
    Counts,
    SortedIds,
    ExpertIds,
    NumPostPad,
    numel,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SCAN: tl.constexpr,
    COUNT_ALL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """This program's expert: its pairs in order from its run's start (the padded runs of the
    experts before it), the sentinel after them up to the run's padded end, its id for each of
    the run's blocks; program 0 also writes the padded total. With `COUNT_ALL` (all `numel`
    ids within one SCAN) it counts every expert's pairs itself instead of reading Counts."""
    wait_for_producers(USE_PDL)
    expert = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    if COUNT_ALL:
        offs = tl.arange(0, SCAN)
        ids = tl.load(Ids + offs, mask=offs < numel, other=-1)
        hits = (ids[:, None] == e[None, :]) & (e[None, :] < num_experts)
        counts = tl.sum(hits.to(tl.int32), axis=0)
    else:
        counts = tl.load(Counts + e, mask=e < num_experts, other=0)
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
    placed = run_start
    for start in range(0, numel, SCAN):
        offs = start + tl.arange(0, SCAN)
        hit = (tl.load(Ids + offs, mask=offs < numel, other=-1) == expert).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit
        tl.store(SortedIds + placed + rank, offs, mask=hit > 0)
        placed += tl.sum(hit, axis=0)


def max_padded_rows(numel: int, num_experts: int, block_m: int) -> int:
    """The most sorted rows `numel` pairs can take: each expert that has any pads its run by at
    most `block_m - 1`, and at most min(E, numel) have any; rounded up to whole blocks."""
    bound = numel + min(num_experts, numel) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids `[R]`, expert_ids `[R / block_m]`, num_tokens_post_padded `[1]`), int32, for
    `topk_ids` `[T, k]` and R = `max_padded_rows(T * k, E, block_m)`: the pair numbers
    (`token * k + slot`) of each expert 0..E-1 in turn, each run padded with T * k to a multiple
    of `block_m`; the expert of each block; the padded total. Entries past the total are
    unspecified (the GEMM's programs there exit)."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    numel = ids.numel()
    rows = max_padded_rows(numel, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    count_all = numel <= _ONE_LAUNCH_PAIRS
    counts = torch.empty(0 if count_all else num_experts, dtype=torch.int32, device=device)
    if not count_all:
        _count_kernel[(num_experts,)](ids, counts, numel, SCAN=_SCAN, **pdl_launch())
    _place_kernel[(num_experts,)](
        ids,
        counts,
        sorted_ids,
        expert_ids,
        num_post_pad,
        numel,
        num_experts,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts),
        SCAN=triton.next_power_of_2(max(numel, 16)) if count_all else _SCAN,
        COUNT_ALL=count_all,
        **pdl_launch(),
    )
    return sorted_ids, expert_ids, num_post_pad
