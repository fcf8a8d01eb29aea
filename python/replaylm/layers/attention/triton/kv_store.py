"""This step's K and V into the paged cache, in one launch for both (faster than two index_put
calls). A layer whose rope kernel stores K/V at the backend's `kv_store_target` skips it:
docs/tuning.md, "KV store in the rope kernel". `to_cache` is how both write a value: an fp8
cache's divided by the layer's scale and saturated, as `KVPool.store` does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers
from replaylm.layers.quantization.fp8 import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache(x, Cache, scale):
    """`x` as the cache `Cache` points into holds it: in float8 `x / scale` saturated at
    +-448 (e4m3's largest) (readers multiply by `scale` again), else `x` in the cache's dtype."""
    if Cache.dtype.element_ty.is_fp8():
        x = tl.clamp(x.to(tl.float32) / scale, -_FP8_MAX, _FP8_MAX)
    return x.to(Cache.dtype.element_ty)


@triton.jit(do_not_specialize_on_alignment=["Loc"])  # one slot per token: any 8-byte offset
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producers(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    ok = offs_h < NUM_KV_HEADS
    dst = slot * stride_ct + offs_h * stride_ch + offs_d
    k = tl.load(K + t * stride_kt + offs_h * stride_kh + offs_d, mask=ok)
    tl.store(KCache + dst, to_cache(k, KCache, k_scale), mask=ok)
    v = tl.load(V + t * stride_vt + offs_h * stride_vh + offs_d, mask=ok)
    tl.store(VCache + dst, to_cache(v, VCache, v_scale), mask=ok)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`k_cache[loc[t]] = k[t]` and `v_cache[loc[t]] = v[t]` for every token t (an fp8 cache's:
    `k[t] / k_scale`, `v[t] / v_scale`, saturated); `k`, `v` are `[T, Hkv, D]` (any row and
    head strides), the caches `[slots, Hkv, D]` with equal strides."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k, v and the caches must be contiguous along the head dim, the caches alike"
        )
    if triton.next_power_of_2(head_dim) != head_dim:
        raise ValueError(f"head dim must be a power of two, got {head_dim}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_scale,
        v_scale,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        num_warps=4,
        **pdl_launch(),
    )
