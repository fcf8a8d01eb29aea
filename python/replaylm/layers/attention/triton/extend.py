"""Extend attention (prefill, chunked prefill): a ragged batch of requests in one launch.

Request i's new tokens are rows `extend_start[i] : extend_start[i] + extend_lens[i]` of q, k and
v; it already has `prefix_lens[i]` tokens in the KV cache, found through the request-to-token
table. Each new token attends to the whole prefix and causally to the new tokens up to itself.

Grid `(num_heads, query blocks, bs)`: a program computes one BLOCK_M block of one request's
queries for one head, in three passes over the keys: the prefix (gathered from the cache), the new
tokens before the block (read straight from k and v, no mask), and the block's diagonal (causal
mask). Query blocks run latest first: they have the most keys, so the tail of the launch is short.

`aligned=True` (the batch-invariant attention of `--deterministic`) makes one pass instead, over
the keys in tiles at fixed positions of the sequence, all read from the cache (the layer stores
the new tokens' K/V before attending): a query's softmax then folds the same tiles in the same
order however its prompt was chunked and whichever batch it came in. An fp8 cache takes that
pass too: the new tokens attend to their K/V as stored, as every other reader sees them.
"""

from __future__ import annotations

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

# head dim -> tiles for 16-bit inputs (block_m a multiple of block_n); why these:
# docs/tuning.md, "Extend attention tiles"
CONFIGS = {
    16: KernelConfig(block_n=64, num_warps=4, num_stages=3, block_m=128),
    32: KernelConfig(block_n=64, num_warps=4, num_stages=3, block_m=128),
    64: KernelConfig(block_n=64, num_warps=4, num_stages=3, block_m=128),
    128: KernelConfig(block_n=64, num_warps=4, num_stages=3, block_m=64),
    256: KernelConfig(block_n=32, num_warps=8, num_stages=2, block_m=64),
}
FLOAT32_CONFIG = KernelConfig(block_n=32, num_warps=4, num_stages=1, block_m=32)  # FMA dots


@triton.jit
def _fold_cached_keys(
    q,
    m_i,
    l_i,
    acc,
    row,
    cols,
    load_ok,
    visible,
    KCache,
    VCache,
    kv_head,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    qk_scale,
    offs_d,
    PRECISION: tl.constexpr,
):
    """Fold the request's cached keys at positions `cols` (loaded where `load_ok`, in q's
    dtype) into the running softmax; logits outside `visible` `[M, N]` are masked."""
    slots = tl.load(row + cols, mask=load_ok, other=0).to(tl.int64)
    k = tl.load(
        KCache + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
        mask=load_ok[:, None],
        other=0.0,
    ).to(q.dtype)
    v = tl.load(
        VCache + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
        mask=load_ok[:, None],
        other=0.0,
    ).to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    return softmax_update(qk, v, m_i, l_i, acc, PRECISION)


# the per-request index pointers sit at 8-byte offsets (a mixed step's extend requests start
# after its decode rows): one compiled variant whatever the offset (docs/tuning.md, "Few
# compiled variants")
@triton.jit(
    do_not_specialize_on_alignment=["ReqPoolIndices", "PrefixLens", "ExtendLens", "ExtendStart"]
)
def _extend_kernel(
    Q,
    KNew,
    VNew,
    Out,
    KCache,
    VCache,
    ReqToToken,
    ReqPoolIndices,
    PrefixLens,
    ExtendLens,
    ExtendStart,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producers(USE_PDL)
    head = tl.program_id(0)
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = tl.program_id(2)
    ext_len = tl.load(ExtendLens + b).to(tl.int32)
    if m_start < ext_len:
        kv_head = head // GROUP
        dtype = Q.dtype.element_ty  # the unaligned passes' dots: q's (a 16-bit cache)
        prefix_len = tl.load(PrefixLens + b).to(tl.int32)
        first = tl.load(ExtendStart + b).to(tl.int64)
        row = ReqToToken + tl.load(ReqPoolIndices + b).to(tl.int64) * stride_rt
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ok = offs_m < ext_len
        q = tl.load(
            Q + (first + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=q_ok[:, None],
            other=0.0,
        )
        q = dot_operand(q, KCache)  # an fp8 cache (the aligned pass only): float16 dots
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

        if ALIGNED:  # every key from the cache, in tiles at fixed sequence positions
            end = prefix_len + tl.minimum(m_start + BLOCK_M, ext_len)
            for n0 in range(0, end, BLOCK_N):
                cols = n0 + offs_n
                load_ok = cols < end
                visible = load_ok[None, :] & (cols[None, :] <= prefix_len + offs_m[:, None])
                m_i, l_i, acc = _fold_cached_keys(
                    q,
                    m_i,
                    l_i,
                    acc,
                    row,
                    cols,
                    load_ok,
                    visible,
                    KCache,
                    VCache,
                    kv_head,
                    stride_kt,
                    stride_kh,
                    stride_vt,
                    stride_vh,
                    qk_scale,
                    offs_d,
                    PRECISION,
                )
        else:
            for n0 in range(0, prefix_len, BLOCK_N):  # the cached prefix, through the table
                cols = n0 + offs_n
                valid = cols < prefix_len
                m_i, l_i, acc = _fold_cached_keys(
                    q,
                    m_i,
                    l_i,
                    acc,
                    row,
                    cols,
                    valid,
                    valid[None, :],
                    KCache,
                    VCache,
                    kv_head,
                    stride_kt,
                    stride_kh,
                    stride_vt,
                    stride_vh,
                    qk_scale,
                    offs_d,
                    PRECISION,
                )

            for n0 in range(0, m_start, BLOCK_N):  # new tokens before this block: all visible
                rows = first + n0 + offs_n
                k = tl.load(
                    KNew + rows[:, None] * stride_knt + kv_head * stride_knh + offs_d[None, :]
                )
                v = tl.load(
                    VNew + rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :]
                )
                qk = tl.dot(q, tl.trans(k.to(dtype)), input_precision=PRECISION) * qk_scale
                m_i, l_i, acc = softmax_update(qk, v.to(dtype), m_i, l_i, acc, PRECISION)

            for n0 in range(m_start, tl.minimum(m_start + BLOCK_M, ext_len), BLOCK_N):  # diagonal
                cols = n0 + offs_n
                valid = cols < ext_len
                rows = first + cols
                k = tl.load(
                    KNew + rows[:, None] * stride_knt + kv_head * stride_knh + offs_d[None, :],
                    mask=valid[:, None],
                    other=0.0,
                )
                v = tl.load(
                    VNew + rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                    mask=valid[:, None],
                    other=0.0,
                )
                qk = tl.dot(q, tl.trans(k.to(dtype)), input_precision=PRECISION) * qk_scale
                qk = tl.where(
                    valid[None, :] & (cols[None, :] <= offs_m[:, None]), qk, float("-inf")
                )
                m_i, l_i, acc = softmax_update(qk, v.to(dtype), m_i, l_i, acc, PRECISION)

        out = acc / l_i[:, None] * v_scale
        tl.store(
            Out + (first + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=q_ok[:, None],
        )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    scale: float,
    config: KernelConfig | None = None,
    aligned: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the new tokens `q` `[T, H, D]` (with their own `k`, `v` `[T, Hkv, D]`)
    over each request's cached prefix plus themselves. `max_extend_len` (>= every extend length)
    sizes the grid. `aligned`: the batch-invariant single pass (the new tokens' K/V must be in the
    cache already), which an fp8 cache takes too, its `k_scale`, `v_scale` applied (it holds
    K / k_scale, V / v_scale). The dots run in q's dtype, over an fp8 cache in float16. Writes
    and returns `out` `[T, H, D]`."""
    num_heads, num_kv_heads, head_dim = check_inputs(q, k_cache, v_cache)
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous along the head dim")
    cfg = config or (FLOAT32_CONFIG if q.dtype == torch.float32 else CONFIGS[head_dim])
    if cfg.block_m % cfg.block_n:
        raise ValueError(f"block_m {cfg.block_m} is not a multiple of block_n {cfg.block_n}")
    bs = prefix_lens.shape[0]
    if bs == 0 or max_extend_len == 0:
        return out
    grid = (num_heads, triton.cdiv(max_extend_len, cfg.block_m), bs)
    _extend_kernel[grid](
        q,
        k,
        v,
        out,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        qk_scale(scale, k_scale),
        v_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PRECISION=dot_precision(q.dtype),
        ALIGNED=aligned or k_cache.dtype == torch.float8_e4m3fn,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(),
    )
    return out
