"""Decode attention: one query token per request over its paged KV, split-K (flash-decoding).

Grid `(num_kv_heads, bs, num_splits)`: a program takes one request, one KV head and one slice of
the sequence, and computes the attention of all query heads of that KV head's group over the
slice (so each KV byte is read once per group). The slices' partial outputs are merged in one of
two ways:
- in one launch (the default, for eager calls): a sequence that fits one slice is written to the
  output directly; otherwise each program writes a normalised partial output and its
  log-sum-exp, then counts itself in on the (request, KV head)'s arrival counter, and the program
  that arrives last merges the partials into the output (loading them all at once) and resets
  the counter to zero for the next launch. A second launch would be host time that a breakable
  graph pays per layer;
- by a merge kernel launched after it (`separate_merge`, for captured graphs, where a launch
  costs no host time): every program writes its partial (a slice past the end writes zeros and
  a log-sum-exp of -inf) and ends, sparing the last program's fence, counter round trip and
  loads (docs/tuning.md, "Decode attention merge kernel").
Both merge the same partials in the same order: their outputs are equal bit for bit.

The grid depends only on the batch size and `num_splits`, never on sequence lengths, so the
launch can be captured in a CUDA graph: each request's slice length is computed in the kernel
from its length, and slices past the end do nothing. A request of length 0 gets zeros.

A launch of more than two waves of programs (large batches, one slice each) may take the requests
in an `order` of its own: longest first (`longest_first`), so that the last programs
to start are the shortest and the GPU is not left with a few long ones at the end of a batch of
mixed lengths (docs/tuning.md, "Decode attention: longest requests first"). Every request's
result is the same in any order. A one-slice launch over few KV heads (`FEW_KV_HEADS`) has few
programs: it takes blocks of 128 keys, one program an SM, always longest first.

A verify step's rows (speculative decoding: one row per verified token of a request, over the
request's table row, each row's length one more than the row before) are taken `rows` at a time
(`rows_per_program`): the program of a run's first row (and of every `rows`-th row after it)
attends for the next `rows` rows of the run at once, each query row masked to its own length,
so the prefix's keys are read once for them, not once per row; the slices span the longest of
them. The other programs of such rows do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replaylm.layers.attention.triton.common import (
    KernelConfig,
    check_inputs,
    dot_operand,
    dot_precision,
    qk_scale,
    softmax_update,
)
from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers

# key block, warps, stages: docs/tuning.md, "Decode attention slices"
CONFIG = KernelConfig(block_n=64, num_warps=4, num_stages=3)
# over an fp8 cache (half the bytes a block) two warps a program beat four from bs 32 on and match
# them below: docs/tuning.md, "FP8 KV cache at decode"
FP8_CONFIG = KernelConfig(block_n=64, num_warps=2, num_stages=3)
FLOAT32_CONFIG = KernelConfig(block_n=32, num_warps=4, num_stages=1)  # full-precision dots: FMA
# a one-slice launch over at most FEW_KV_HEADS KV heads (Qwen3-MoE's 4) has few programs for its
# bytes: blocks of 128 keys in two stages (one program an SM) keep more of them in flight, the
# requests longest first: docs/tuning.md, "Decode attention over few KV heads"
FEW_KV_HEADS = 4
FEW_KV_HEADS_CONFIG = KernelConfig(block_n=128, num_warps=4, num_stages=2)
MERGE_WARPS = 4  # warps of the merge kernel: docs/tuning.md, "Decode attention merge kernel"
MIN_SPLIT_LEN = 64  # tokens (one block): docs/tuning.md, "Decode attention slices"
# slices per request: about PROGRAMS_PER_SM programs per multiprocessor over the batch's
# (request, KV head) pairs, rounded down to a power of two, between MIN_SPLITS and MAX_SPLITS;
# one slice (no merge) once those pairs alone exceed that. Tuned inside a whole decode step, where
# fewer, longer slices win than for the kernel alone: docs/tuning.md, "Decode attention slices".
MIN_SPLITS, MAX_SPLITS = 2, 16
# how far back a verify row looks for the first row of its run (`rows_per_program`): a run is a
# request's last token and drafts, so at most this many rows
MAX_RUN = tl.constexpr(64)
PROGRAMS_PER_SM = 2
# a launch of more than this many programs per multiprocessor (two waves of PROGRAMS_PER_SM)
# starts its requests longest first: docs/tuning.md, "Decode attention: longest requests first"
LONGEST_FIRST_PROGRAMS_PER_SM = 4


def merge_unroll(num_splits: int) -> int:
    """How many slices a merge's unrolled loop covers for `num_splits` (a constexpr of the
    kernels, while the count itself is a runtime argument): MAX_SPLITS for every count the
    default policy picks, so one compiled variant serves every batch size (each variant is a
    JIT compile on a first start), larger counts the next power of two."""
    return max(MAX_SPLITS, triton.next_power_of_2(num_splits))


def num_kv_splits(batch_size: int, num_kv_heads: int, sm_count: int) -> int:
    """Slices per request for a batch of `batch_size`: one when the batch's (request, KV head)
    pairs alone exceed PROGRAMS_PER_SM programs per multiprocessor (no merge to pay for); else a
    power of two from MIN_SPLITS to MAX_SPLITS (so `merge_unroll`'s one variant serves them
    all), the largest with at most PROGRAMS_PER_SM programs per multiprocessor unless that is
    below MIN_SPLITS. Depends on the batch shape only, as graph capture needs."""
    want = PROGRAMS_PER_SM * sm_count // (batch_size * num_kv_heads)
    if want == 0:
        return 1
    return min(MAX_SPLITS, max(MIN_SPLITS, 1 << want.bit_length() - 1))


def starts_longest_first(batch_size: int, num_kv_heads: int, sm_count: int) -> bool:
    """Whether a one-slice launch of `batch_size` requests should start them longest first
    (`longest_first`): when its (request, KV head) programs fill more than two waves, so that
    the order decides which programs finish last; always over few KV heads, whose launch holds
    one program an SM (`FEW_KV_HEADS_CONFIG`)."""
    if num_kv_heads <= FEW_KV_HEADS:
        return True
    return batch_size * num_kv_heads > LONGEST_FIRST_PROGRAMS_PER_SM * sm_count


@triton.jit
def _split_len(seq_len, num_splits, min_split_len):
    """Tokens per slice of a sequence: a multiple of `min_split_len` (a slice may end inside a key
    block: its last block is masked)."""
    per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split_len)
    return tl.cdiv(per_split, min_split_len) * min_split_len


@triton.jit
def _run_offset(ReqPoolIndices, SeqLens, b, table_row, seq_len):
    """How many rows before row `b` continue the same run (capped at MAX_RUN): same table row,
    lengths one apart per row."""
    back = tl.arange(0, MAX_RUN) + 1
    prev = b - back
    ok = prev >= 0
    prev_row = tl.load(ReqPoolIndices + prev, mask=ok, other=-1)
    prev_len = tl.load(SeqLens + prev, mask=ok, other=-1).to(tl.int32)
    return tl.sum((ok & (prev_row == table_row) & (prev_len == seq_len - back)).to(tl.int32), 0)


# ReqPoolIndices, SeqLens, Order: one element per request, at any 8-byte offset; num_splits (and the
# log-sum-exps' head stride, which equals it) and has_order: runtime values, so the batch sizes'
# slice counts and orders share one compiled variant (docs/tuning.md, "Few compiled variants")
@triton.jit(
    do_not_specialize=["num_splits", "stride_mlh", "has_order", "num_rows"],
    do_not_specialize_on_alignment=["ReqPoolIndices", "SeqLens", "Order"],
)
def _decode_kernel(
    Q,
    KCache,
    VCache,
    ReqToToken,
    ReqPoolIndices,
    SeqLens,
    Order,
    Out,
    MidO,
    MidLse,
    Arrivals,
    qk_scale,
    v_scale,
    min_split_len,
    num_splits,
    has_order,
    num_rows,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rt,
    stride_ot,
    stride_oh,
    stride_mot,
    stride_moh,
    stride_mos,
    stride_mlt,
    stride_mlh,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    PRECISION: tl.constexpr,
    SEPARATE_MERGE: tl.constexpr,
    USE_PDL: tl.constexpr,
    ROWS: tl.constexpr = 1,
):
    wait_for_producers(USE_PDL)
    # the KV heads vary fastest: programs start in request order, the order's when given
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    if has_order:
        b = tl.load(Order + b).to(tl.int32)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    # issued together, before the length is known: one round trip instead of three in a row
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    table_row = tl.load(ReqPoolIndices + b)
    row = ReqToToken + table_row.to(tl.int64) * stride_rt
    if ROWS == 1:
        heads = kv_head * GROUP + offs_g
        head_ok = offs_g < GROUP
        q_at = Q + b * stride_qt
        out_at = Out + b * stride_ot
        mid_o_at = MidO + b * stride_mot
        mid_lse_at = MidLse + b * stride_mlt
    else:  # query slot i: row b + i // GROUP of the run, head i % GROUP of the KV head's group
        t = offs_g // GROUP
        rows = b + t
        heads = kv_head * GROUP + offs_g % GROUP
        in_batch = (t < ROWS) & (rows < num_rows)
        slot_row = tl.load(ReqPoolIndices + rows, mask=in_batch, other=-1)
        slot_len = tl.load(SeqLens + rows, mask=in_batch, other=0).to(tl.int32)
        offset = _run_offset(ReqPoolIndices, SeqLens, b, table_row, seq_len)
        # else an earlier row's program attends for this row (a block: Triton's interpreter
        # rejects a scalar in a mask)
        first = tl.full([BLOCK_H], offset, tl.int32) % ROWS == 0
        head_ok = in_batch & (slot_row == table_row) & (slot_len == seq_len + t) & first
        row_len = tl.where(head_ok, slot_len, 0)
        seq_len = tl.max(row_len, 0)  # the slices span the run's longest row
        q_at = Q + rows[:, None] * stride_qt
        out_at = Out + rows[:, None] * stride_ot
        mid_o_at = MidO + rows[:, None] * stride_mot
        mid_lse_at = MidLse + rows * stride_mlt
    q = tl.load(
        q_at + heads[:, None] * stride_qh + offs_d[None, :], mask=head_ok[:, None], other=0.0
    )
    q = dot_operand(q, KCache)
    split_len = _split_len(seq_len, num_splits, min_split_len)
    num_active = tl.cdiv(seq_len, split_len)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    out_ptrs = out_at + heads[:, None] * stride_oh + offs_d[None, :]
    mid_o = mid_o_at + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
    mid_lse = mid_lse_at + heads * stride_mlh + split
    if start >= end:  # a slice past the end (every slice of an empty sequence)
        if SEPARATE_MERGE:  # a part the merge weighs 0
            _store_partial(
                mid_o,
                mid_lse,
                tl.zeros([BLOCK_H, HEAD_DIM], tl.float32),
                tl.full([BLOCK_H], float("-inf"), tl.float32),
                head_ok,
            )
        elif (seq_len == 0) & (split == 0):
            tl.store(
                out_ptrs, tl.zeros([BLOCK_H, HEAD_DIM], Out.dtype.element_ty), mask=head_ok[:, None]
            )
    else:
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + offs_n
            valid = cols < end
            slots = tl.load(row + cols, mask=valid, other=0).to(tl.int64)
            k = tl.load(
                KCache + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(q.dtype)
            v = tl.load(
                VCache + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if ROWS == 1:
                qk = tl.where(valid[None, :], qk, float("-inf"))
            else:  # finite: a row may have no key of its own in a block (its max stays finite)
                own = valid[None, :] & (cols[None, :] < row_len[:, None])
                qk = tl.where(own, qk, -1.0e30)
            m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, PRECISION)
        value = acc / l_i[:, None] * v_scale
        lse = m_i + tl.log2(l_i)
        if ROWS > 1:  # a row ending before this slice: a part the merge weighs 0
            mine = row_len > start
            value = tl.where(mine[:, None], value, 0.0)
            lse = tl.where(mine, lse, float("-inf"))
        if SEPARATE_MERGE:
            _store_partial(mid_o, mid_lse, value, lse, head_ok)
        elif num_active == 1:
            tl.store(out_ptrs, value.to(Out.dtype.element_ty), mask=head_ok[:, None])
        else:
            _store_partial(mid_o, mid_lse, value, lse, head_ok)
            tl.debug_barrier()  # every thread's partial is stored before the arrival counts
            counter = Arrivals + b * NUM_KV_HEADS + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == num_active - 1:
                tl.atomic_xchg(counter, 0)  # the last to arrive: reset for the next launch, merge
                run_rows = 1
                if ROWS > 1:
                    run_rows = tl.sum(head_ok.to(tl.int32), 0) // GROUP
                for r in tl.static_range(ROWS):
                    if r < run_rows:
                        _merge_partials(
                            MidO + (b + r) * stride_mot,
                            MidLse + (b + r) * stride_mlt,
                            Out + (b + r) * stride_ot,
                            kv_head * GROUP,
                            num_active,
                            stride_moh,
                            stride_mos,
                            stride_mlh,
                            stride_oh,
                            GROUP,
                            HEAD_DIM,
                            MERGE_UNROLL,
                        )


def launch_config(
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    num_splits: int,
    rows_per_program: int,
) -> KernelConfig:
    """The decode kernel's launch for a query of `q_dtype` over a cache of `cache_dtype`:
    `FEW_KV_HEADS_CONFIG` for one slice of one row a program over at most FEW_KV_HEADS KV heads
    of a 16-bit cache, heads of at most 128 (its two stages of 128 keys fill shared memory)."""
    if q_dtype == torch.float32:
        return FLOAT32_CONFIG
    if cache_dtype == torch.float8_e4m3fn:
        return FP8_CONFIG
    few = num_kv_heads <= FEW_KV_HEADS and head_dim <= 128
    return FEW_KV_HEADS_CONFIG if few and num_splits == 1 and rows_per_program == 1 else CONFIG


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The requests' indices by length, longest first: `decode_attention`'s `order` for a batch
    of more than two waves of programs (`starts_longest_first`; one sort kernel, no host
    sync)."""
    return torch.argsort(seq_lens, descending=True)


@triton.jit
def _store_partial(mid_o, mid_lse, value, lse, head_ok):
    """One slice's normalised partial output `[BLOCK_H, D]` and base-2 log-sum-exp `[BLOCK_H]`."""
    tl.store(mid_o, value, mask=head_ok[:, None])
    tl.store(mid_lse, lse, mask=head_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_mlh"])  # as _decode_kernel
def _merge_kernel(
    MidO,
    MidLse,
    Out,
    num_splits,
    stride_mot,
    stride_moh,
    stride_mos,
    stride_mlt,
    stride_mlh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid `(bs, num_kv_heads)`: merge every slice's partial of one request and KV head group
    (slices past the end weigh 0) into the output."""
    wait_for_producers(USE_PDL)
    b = tl.program_id(0)
    _merge_partials(
        MidO + b * stride_mot,
        MidLse + b * stride_mlt,
        Out + b * stride_ot,
        tl.program_id(1) * GROUP,
        num_splits,
        stride_moh,
        stride_mos,
        stride_mlh,
        stride_oh,
        GROUP,
        HEAD_DIM,
        MERGE_UNROLL,
    )


@triton.jit
def _merge_partials(
    MidO,
    MidLse,
    Out,
    first_head,
    num_parts,
    stride_moh,
    stride_mos,
    stride_mlh,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
):
    """Combine the first `num_parts` (at most MERGE_UNROLL) normalised partial outputs of heads
    `first_head` .. `first_head + GROUP - 1` of one request (`MidO` `[H, splits, D]`, their
    base-2 log-sum-exps `MidLse` `[H, splits]`) into `Out` `[H, D]`; a part whose log-sum-exp is
    -inf weighs 0, and with no other part the output is zeros. The loop over slices is unrolled
    to MERGE_UNROLL, so every partial's load is issued at once (one round trip, not one per
    slice); parts from `num_parts` on load nothing and fold in as exact no-ops (weight 0, factor
    1). Each thread keeps its own elements (no cross-thread reduction); loads bypass L1: other
    programs wrote them."""
    GROUP_P2: tl.constexpr = triton.next_power_of_2(GROUP)
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = first_head + offs_g
    head_ok = offs_g < GROUP
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for part in tl.static_range(MERGE_UNROLL):
        # compared as a block: Triton's interpreter rejects a scalar comparison in the mask
        ok = head_ok & (tl.full([GROUP_P2], part, tl.int32) < num_parts)
        lse = tl.load(
            MidLse + heads * stride_mlh + part, mask=ok, other=float("-inf"), cache_modifier=".cg"
        )
        lse = tl.where(head_ok, lse, 0.0)  # padded heads: finite, never stored
        value = tl.load(
            MidO + heads[:, None] * stride_moh + part * stride_mos + offs_d[None, :],
            mask=ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, lse)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no finite part yet: weights 0
        alpha = tl.exp2(m - base)
        weight = tl.exp2(lse - base)
        acc = acc * alpha[:, None] + value * weight[:, None]
        total = total * alpha + weight
        m = m_new
    out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)
    tl.store(
        Out + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=head_ok[:, None],
    )


@dataclass(frozen=True)
class DecodeWorkspace:
    """Scratch of one decode launch, reusable by the next launch on the same stream (every layer
    of a step): partial outputs and their log-sum-exps, and the arrival counters (zero between
    launches: the kernel resets them)."""

    mid_o: torch.Tensor  # [bs, H, splits, D] float32
    mid_lse: torch.Tensor  # [bs, H, splits] float32
    arrivals: torch.Tensor  # [bs * Hkv] int32


def decode_workspace(
    q: torch.Tensor, num_kv_heads: int, num_splits: int, arrivals: torch.Tensor | None = None
) -> DecodeWorkspace:
    """A workspace for `q` `[bs, H, D]` in `num_splits` slices; `arrivals` (at least
    bs * num_kv_heads zeros) may be given, e.g. a static buffer under a CUDA graph."""
    bs, num_heads, head_dim = q.shape
    if arrivals is None:
        arrivals = torch.zeros(bs * num_kv_heads, dtype=torch.int32, device=q.device)
    return DecodeWorkspace(
        torch.empty((bs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device),
        torch.empty((bs, num_heads, num_splits), dtype=torch.float32, device=q.device),
        arrivals,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int,
    min_split_len: int = MIN_SPLIT_LEN,
    config: KernelConfig | None = None,
    workspace: DecodeWorkspace | None = None,
    separate_merge: bool = False,
    order: torch.Tensor | None = None,
    rows_per_program: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of `q` `[bs, H, D]` (request i's one new token) over the `seq_lens[i]` tokens of
    request i, whose KV slots are `req_to_token[req_pool_indices[i], :seq_lens[i]]` in
    `k_cache`/`v_cache` `[slots, Hkv, D]`. Writes and returns `out` `[bs, H, D]`. `workspace`:
    from `decode_workspace` for this q and `num_splits` (default: a fresh one). Slice counts up to
    MAX_SPLITS share one compiled variant (`merge_unroll`).
    `separate_merge`: merge the slices in a second launch (for CUDA-graph capture; the same
    numbers as the default single launch, which costs one launch less of host time).
    `order`: a permutation of the requests `[bs]` in which the programs start (`longest_first`);
    the output is the same. `rows_per_program` > 1: the rows are a verify step's (runs of rows
    of one request, at most MAX_RUN long), attended that many at a time (no `order`).
    `k_scale`, `v_scale`: an fp8 cache's (it holds K / k_scale, V / v_scale); the dots run in
    q's dtype, over an fp8 cache in float16."""
    num_heads, num_kv_heads, head_dim = check_inputs(q, k_cache, v_cache)
    bs = q.shape[0]
    group = num_heads // num_kv_heads
    cfg = config or launch_config(
        q.dtype, k_cache.dtype, num_kv_heads, head_dim, num_splits, rows_per_program
    )
    ws = workspace or decode_workspace(q, num_kv_heads, num_splits)
    mid_o, mid_lse = ws.mid_o, ws.mid_lse
    separate = separate_merge and num_splits > 1  # one slice: written directly either way
    assert rows_per_program == 1 or order is None
    _decode_kernel[(num_kv_heads, bs, num_splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        seq_lens if order is None else order,
        out,
        mid_o,
        mid_lse,
        ws.arrivals,
        qk_scale(scale, k_scale),
        v_scale,
        min_split_len,
        num_splits,
        int(order is not None),
        bs,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        out.stride(0),
        out.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(rows_per_program * group)),
        HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n,
        MERGE_UNROLL=merge_unroll(num_splits),
        PRECISION=dot_precision(q.dtype),
        SEPARATE_MERGE=separate,
        ROWS=rows_per_program,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(),
    )
    if separate:
        _merge_kernel[(bs, num_kv_heads)](
            mid_o,
            mid_lse,
            out,
            num_splits,
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            GROUP=group,
            HEAD_DIM=head_dim,
            MERGE_UNROLL=merge_unroll(num_splits),
            num_warps=MERGE_WARPS,
            **pdl_launch(),
        )
    return out
