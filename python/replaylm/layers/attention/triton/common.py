"""Pieces the Triton attention kernels share: launch configs, input checks, the softmax update."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) = exp2(x * log2(e))
# the model's dtypes, and float8 e4m3 (`--kv-cache-dtype fp8_e4m3`), whose tiles the kernels
# convert (exactly) to the dots' dtype as they load them: float16 (`dot_operand`)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


class KernelConfig(NamedTuple):
    """Tile sizes and launch shape of one kernel (block_m only matters for extend)."""

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 1


def check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim); ValueError for shapes the kernels do not take."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if head_dim not in (16, 32, 64, 128, 256) or k_cache.shape[2] != head_dim:
        raise ValueError(
            f"head dim must be a power of two in 16..256 on q and the cache, got "
            f"{head_dim} and {k_cache.shape[2]}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("the K and V caches differ in shape or dtype")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("q and the KV cache must be contiguous along the head dim")
    if k_cache.dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {k_cache.dtype} is not one of {KV_DTYPES}")
    return num_heads, num_kv_heads, head_dim


def qk_scale(scale: float, k_scale: float) -> float:
    """The kernels' logit scale: the softmax scale with an fp8 cache's `k_scale` folded in
    (base.py), in base 2."""
    return scale * k_scale * LOG2E


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in full precision (not tf32): a float32 model stays a reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def dot_operand(q, KCache):
    """`q` as the dots take it: a 16-bit q over an fp8 cache in float16 (clamped to its range),
    whose conversion from e4m3 is one instruction a pair of values where bfloat16's takes three
    more (docs/tuning.md, "FP8 KV cache at decode"); else as it is (a float32 model's dots stay
    float32)."""
    if KCache.dtype.element_ty == tl.float8e4nv and q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def softmax_update(qk, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one block of keys into the running softmax. `qk` `[M, N]` are base-2 logits (masked
    entries -inf; every row has seen at least one finite logit by now), `v` `[N, D]`; `m_i`,
    `l_i` `[M]` are the running max and sum, `acc` `[M, D]` the unnormalised output."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
