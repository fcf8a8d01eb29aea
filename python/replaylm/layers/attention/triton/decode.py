"""Decode attention: one query token per request over its paged KV, split-K (flash-decoding).

Stage 1, grid `(bs, num_kv_heads, num_splits)`: a program takes one request, one KV head and one
slice of the sequence, and computes the attention of all query heads of that KV head's group over
the slice (so each KV byte is read once per group), writing a normalised partial output and its
log-sum-exp. Stage 2, grid `(bs, num_heads)`, merges the partials of a request's non-empty slices.

The grid depends only on the batch size and `num_splits`, never on sequence lengths, so both
launches can be captured in a CUDA graph: each request's slice length is computed in the kernel
from its length, and slices past the end do nothing. A request of length 0 gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.attention.triton.common import (
    LOG2E,
    KernelConfig,
    check_inputs,
    dot_precision,
    softmax_update,
)

CONFIG = KernelConfig(block_n=64, num_warps=4, num_stages=3)
FLOAT32_CONFIG = KernelConfig(block_n=32, num_warps=4, num_stages=1)  # full-precision dots: FMA
MIN_SPLIT_LEN = 256  # tokens: shorter slices would spend more on the merge than they save
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # stage-1 programs to aim for, per multiprocessor


def num_kv_splits(batch_size: int, num_kv_heads: int, sm_count: int) -> int:
    """Slices per request: enough stage-1 programs to fill the GPU, a power of two (few kernel
    variants), at most MAX_SPLITS. Depends on the batch shape only, as graph capture needs."""
    want = triton.cdiv(PROGRAMS_PER_SM * sm_count, batch_size * num_kv_heads)
    return min(MAX_SPLITS, triton.next_power_of_2(want))


@triton.jit
def _split_len(seq_len, num_splits, min_split_len, BLOCK_N: tl.constexpr):
    """Tokens per slice of a sequence: a multiple of BLOCK_N, at least `min_split_len`."""
    per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split_len)
    return tl.cdiv(per_split, BLOCK_N) * BLOCK_N


@triton.jit
def _decode_partial_kernel(
    Q, KCache, VCache, ReqToToken, ReqPoolIndices, SeqLens, MidO, MidLse,
    qk_scale, num_splits, min_split_len,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    split_len = _split_len(seq_len, num_splits, min_split_len, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        offs_g = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_g
        head_ok = offs_g < GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=head_ok[:, None], other=0.0).to(KCache.dtype.element_ty)
        row = ReqToToken + tl.load(ReqPoolIndices + b).to(tl.int64) * stride_rt
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + offs_n
            valid = cols < end
            slots = tl.load(row + cols, mask=valid, other=0).to(tl.int64)
            k = tl.load(KCache + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            v = tl.load(VCache + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, PRECISION)
        mid = b * stride_mot + heads * stride_moh + split * stride_mos
        tl.store(MidO + mid[:, None] + offs_d[None, :], acc / l_i[:, None], mask=head_ok[:, None])
        tl.store(MidLse + b * stride_mlt + heads * stride_mlh + split, m_i + tl.log2(l_i),
                 mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    MidO, MidLse, Out, SeqLens, num_splits, min_split_len,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    split_len = _split_len(seq_len, num_splits, min_split_len, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for split in range(0, tl.cdiv(seq_len, split_len)):
        lse = tl.load(MidLse + b * stride_mlt + head * stride_mlh + split)
        part = tl.load(MidO + b * stride_mot + head * stride_moh + split * stride_mos + offs_d)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + part * weight
        total = total * alpha + weight
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + b * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, scale: float,
    num_splits: int, min_split_len: int = MIN_SPLIT_LEN, config: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of `q` `[bs, H, D]` (request i's one new token) over the `seq_lens[i]` tokens of
    request i, whose KV slots are `req_to_token[req_pool_indices[i], :seq_lens[i]]` in
    `k_cache`/`v_cache` `[slots, Hkv, D]`. Writes and returns `out` `[bs, H, D]`."""
    num_heads, num_kv_heads, head_dim = check_inputs(q, k_cache, v_cache)
    bs = q.shape[0]
    group = num_heads // num_kv_heads
    cfg = config or (FLOAT32_CONFIG if k_cache.dtype == torch.float32 else CONFIG)
    mid_o = torch.empty((bs, num_heads, num_splits, head_dim), dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty((bs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(bs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        scale * LOG2E, num_splits, min_split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n, PRECISION=dot_precision(k_cache.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _decode_merge_kernel[(bs, num_heads)](
        mid_o, mid_lse, out, seq_lens, num_splits, min_split_len,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, num_warps=max(1, head_dim // 128),
    )
    return out
