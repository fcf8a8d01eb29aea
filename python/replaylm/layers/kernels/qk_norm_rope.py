"""Per-head q/k RMSNorm (optional, Qwen3) and rope (neox rotate-half), in one launch; optionally
also this step's K (as rotated) and V into the paged KV cache, which saves the store kernel.

Reads q `[T, H*D]` and k `[T, Hkv*D]` as given: any row stride, unit column stride, so the
column slices of the fused QKV output are read in place. Writes fresh contiguous q and k in the
input dtype. Per head: the optional norm has the same numbers as `RMSNorm` (float32, rounded to
the dtype, times the weight, rounded again); then rope with cos/sin from the float32 tables at
`positions`, rounded to the dtype as the torch code does, `x*cos + rotate_half(x)*sin`
computed in float32 and rounded once (the torch code rounds each product and the sum, so
half-precision outputs can differ by one rounding). K and V are stored as the Triton KV store
writes them (`to_cache`: an fp8 cache's divided by the layer's scales and saturated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.attention.triton.kv_store import to_cache
from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers

# (v, k cache, v cache, slots): where qk_norm_rope also stores this step's K and V
KVStore = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@triton.jit
def _norm_rope_heads(
    Src,
    Dst,
    W,
    Cache,
    scale,
    first_head,
    num_heads,
    stride_ch,
    cos1,
    cos2,
    sin1,
    sin2,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
):
    """Heads `first_head ..` (BLOCK_H of them, masked at `num_heads`) of one token: `Src` and
    `Dst` point at the token's row, `Cache` (with STORE, its fp8 `scale`) at its KV slot, heads
    `stride_ch` apart; each head is two halves of HALF columns."""
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    offs = heads * HEAD_DIM + cols
    x1 = tl.load(Src + offs, mask=mask, other=0.0)
    x2 = tl.load(Src + offs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(W + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + cols + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y1 = (x1 * cos1 - x2 * sin1).to(dtype)
    y2 = (x2 * cos2 + x1 * sin2).to(dtype)
    tl.store(Dst + offs, y1, mask=mask)
    tl.store(Dst + offs + HALF, y2, mask=mask)
    if STORE:
        slot_offs = heads * stride_ch + cols
        tl.store(Cache + slot_offs, to_cache(y1, Cache, scale), mask=mask)
        tl.store(Cache + slot_offs + HALF, to_cache(y2, Cache, scale), mask=mask)


@triton.jit
def _copy_heads(
    Src,
    Cache,
    scale,
    first_head,
    num_heads,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Heads `first_head ..` of one token's row `Src` into its KV slot `Cache` as they are (an
    fp8 cache's divided by `scale`)."""
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HEAD_DIM)[None, :]
    ok = heads < num_heads
    x = tl.load(Src + heads * HEAD_DIM + cols, mask=ok)
    tl.store(Cache + heads * stride_ch + cols, to_cache(x, Cache, scale), mask=ok)


# one element per token is read through Pos and Loc: their alignment (a batch's packed index
# fields sit at any 8-byte offset) need not make a variant of its own
@triton.jit(do_not_specialize_on_alignment=["Pos", "Loc"])
def _qk_norm_rope_kernel(
    Q,
    K,
    QOut,
    KOut,
    QW,
    KW,
    Cos,
    Sin,
    Pos,
    V,
    KCache,
    VCache,
    Loc,
    stride_q,
    stride_k,
    stride_v,
    stride_cos,
    stride_ct,
    stride_ch,
    eps,
    k_scale,
    v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (T, q head blocks + k head blocks): one block of one token's q or k heads (a k
    block, with STORE, also stores its K heads and the same V heads at the token's slot)."""
    wait_for_producers(USE_PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    half = cols < HALF
    table = tl.load(Pos + t).to(tl.int64) * stride_cos + cols
    dtype = Q.dtype.element_ty  # cos/sin rounded to the activations' dtype, as the torch code
    cos1 = tl.load(Cos + table, mask=half, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(Cos + table + HALF, mask=half, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(Sin + table, mask=half, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(Sin + table + HALF, mask=half, other=0.0).to(dtype).to(tl.float32)
    if block < q_blocks:
        _norm_rope_heads(
            Q + t * stride_q,
            QOut + t * (NUM_HEADS * HEAD_DIM),
            QW,
            Q,
            1.0,
            block * BLOCK_H,
            NUM_HEADS,
            0,
            cos1,
            cos2,
            sin1,
            sin2,
            eps,
            HEAD_DIM,
            HALF,
            BLOCK_HALF,
            BLOCK_H,
            HAS_NORM,
            False,
        )
    else:
        first = (block - q_blocks) * BLOCK_H
        slot = 0  # the token's KV slot (offset into the caches), read only to store
        if STORE:
            slot = tl.load(Loc + t).to(tl.int64) * stride_ct
        _norm_rope_heads(
            K + t * stride_k,
            KOut + t * (NUM_KV_HEADS * HEAD_DIM),
            KW,
            KCache + slot,
            k_scale,
            first,
            NUM_KV_HEADS,
            stride_ch,
            cos1,
            cos2,
            sin1,
            sin2,
            eps,
            HEAD_DIM,
            HALF,
            BLOCK_HALF,
            BLOCK_H,
            HAS_NORM,
            STORE,
        )
        if STORE:
            _copy_heads(
                V + t * stride_v,
                VCache + slot,
                v_scale,
                first,
                NUM_KV_HEADS,
                stride_ch,
                HEAD_DIM,
                BLOCK_H,
            )


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    heads_per_program: int = 4,
    kv_store: KVStore | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope (after a per-head RMSNorm when `norm` = (q weight, k weight, eps)) of q `[T, H*D]`
    and k `[T, Hkv*D]` (same dtype; unit column stride, any row stride) at `positions` `[T]`;
    `cos_cache`/`sin_cache` `[max_positions, D]` float32 (neox layout). Returns new contiguous
    q and k. With `kv_store` = (v `[T, Hkv*D]` like k, k cache, v cache `[slots, Hkv, D]` with
    equal strides and unit column stride, slots `[T]`), also `k_cache[slots[t]]` = the returned
    k[t] and `v_cache[slots[t]] = v[t]` (an fp8 cache's divided by `kv_scales` = (k_scale,
    v_scale), saturated). `heads_per_program` (a power of two) sets the launch: (T, head
    blocks)."""
    if q.stride(1) != 1 or k.stride(1) != 1 or q.dtype != k.dtype:
        raise ValueError("q and k must have unit column stride and one dtype")
    if head_dim % 2 or q.shape[1] % head_dim or k.shape[1] % head_dim:
        raise ValueError(f"head dim {head_dim} must be even and divide q's and k's widths")
    if (
        cos_cache.shape[1] != head_dim
        or cos_cache.stride(1) != 1
        or (cos_cache.stride() != sin_cache.stride())
    ):
        raise ValueError("the cos/sin tables must be [positions, head dim], rows alike")
    num_tokens = q.shape[0]
    num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    q_out = torch.empty((num_tokens, num_heads * head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads * head_dim), dtype=k.dtype, device=k.device)
    q_weight, k_weight, eps = norm if norm is not None else (cos_cache, cos_cache, 0.0)
    if kv_store is not None:
        v, k_cache, v_cache, slots = kv_store
        _check_kv_store(k, v, k_cache, v_cache, head_dim)
    else:
        v, k_cache, v_cache, slots = k, k, k, positions  # only `slots` is read, not used
    blocks = triton.cdiv(num_heads, heads_per_program) + triton.cdiv(
        num_kv_heads, heads_per_program
    )
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, blocks)](
            q,
            k,
            q_out,
            k_out,
            q_weight,
            k_weight,
            cos_cache,
            sin_cache,
            positions,
            v,
            k_cache,
            v_cache,
            slots,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            cos_cache.stride(0),
            k_cache.stride(0),
            k_cache.stride(1) if kv_store is not None else 0,
            eps,
            *kv_scales,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_H=heads_per_program,
            HAS_NORM=norm is not None,
            STORE=kv_store is not None,
            num_warps=4,
            **pdl_launch(),
        )
    return q_out, k_out


def _check_kv_store(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int
) -> None:
    if v.shape != k.shape or v.stride(1) != 1 or v.dtype != k.dtype:
        raise ValueError("v must be shaped like k, with unit column stride and k's dtype")
    if (
        k_cache.stride() != v_cache.stride()
        or k_cache.stride(2) != 1
        or (k_cache.shape[1:] != (k.shape[1] // head_dim, head_dim))
    ):
        raise ValueError("the caches must be [slots, Hkv, D] with unit column stride, alike")
    if triton.next_power_of_2(head_dim) != head_dim:
        raise ValueError(f"storing K/V needs a power-of-two head dim, got {head_dim}")
