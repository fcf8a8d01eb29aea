"""Random paged-attention cases for checking attention backends against torch_native.

A case is a KV pool whose every slot holds random K/V (so a wrong slot shows), requests on
shuffled request rows whose tokens sit on shuffled KV slots, and random q/k/v for the new tokens.
The reference is torch_native in float32 on an upcast copy of the pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from replaylm.layers.attention.base import AttentionBackend
from replaylm.layers.attention.layer import Attention
from replaylm.layers.attention.torch_native import TorchNativeAttnBackend
from replaylm.layers.attention.triton.decode import decode_attention
from replaylm.layers.attention.triton.extend import extend_attention
from replaylm.mem_cache.kv_cache import KVCache
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool
from replaylm.mem_cache.token_allocator import TokenSlotAllocator
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class Case:
    batch: ForwardBatch
    layer: Attention
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32 (NaN when out has NaN)."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def make_case(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    backend: AttentionBackend | None = None,
    spare_slots: int = 64,
) -> Case:
    """Request i has `prefix_lens[i]` cached tokens and `extend_lens[i]` new ones."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    bs = len(prefix_lens)
    total = sum(prefix_lens) + sum(extend_lens)
    pool = KVPool(total + spare_slots, 1, num_kv_heads, head_dim, dtype, device)
    pool.k_buffers[0].copy_(randn(*pool.k_buffers[0].shape))
    pool.v_buffers[0].copy_(randn(*pool.v_buffers[0].shape))
    context = max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)) + 3
    table = ReqToTokenPool(bs + 5, context, device)
    rows = torch.randperm(bs + 5, generator=gen, device=device)[:bs].tolist()
    slots = 1 + torch.randperm(total + spare_slots, generator=gen, device=device)[:total]
    lengths = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    table.write(
        torch.cat(
            [
                r * table.row_width + torch.arange(n, device=device)
                for r, n in zip(rows, lengths, strict=True)
            ]
        ),
        slots.to(torch.int32),
    )
    new_slots, offset = [], 0
    for p, e in zip(prefix_lens, extend_lens, strict=True):
        new_slots.append(slots[offset + p : offset + p + e])
        offset += p + e
    batch = ForwardBatch.create(
        mode,
        [[1] * e for e in extend_lens],
        prefix_lens,
        rows,
        torch.cat(new_slots).tolist(),
        KVCache(pool, TokenSlotAllocator(pool.size), table),
        backend or TorchNativeAttnBackend(),
    )
    t = sum(extend_lens)
    layer = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5, layer_id=0)
    return Case(
        batch,
        layer,
        randn(t, num_heads, head_dim),
        randn(t, num_kv_heads, head_dim),
        randn(t, num_kv_heads, head_dim),
    )


def reference(case: Case) -> torch.Tensor:
    """torch_native's output in float32, over a float32 copy of the pool (new K/V stored)."""
    b = case.batch
    pool = KVPool(
        b.kv.pool.size, 1, b.kv.pool.num_kv_heads, b.kv.pool.head_dim, torch.float32, case.q.device
    )
    pool.k_buffers[0].copy_(b.kv.pool.k_buffers[0])
    pool.v_buffers[0].copy_(b.kv.pool.v_buffers[0])
    native = TorchNativeAttnBackend()
    kv = dataclasses.replace(b.kv, pool=pool)
    ref_batch = dataclasses.replace(b, kv=kv, attn_backend=native)
    native.init_forward_metadata(ref_batch)
    q = case.q.float()
    return native.forward(
        q, case.k.float(), case.v.float(), case.layer, ref_batch, torch.empty_like(q)
    )


def store_and_attend(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: Attention,
    batch: ForwardBatch,
) -> torch.Tensor:
    """What the attention layer does per step: store K/V, then attend into a fresh output."""
    backend.store_kv(k, v, layer, batch)
    return backend.forward(q, k, v, layer, batch, torch.empty_like(q))


def triton_decode(
    case: Case, out: torch.Tensor, splits: int, seq_lens: torch.Tensor | None = None, **launch
) -> None:
    """The Triton decode kernel on a decode case (layer 0 of its pool, its table and rows) into
    `out` in `splits` slices; `seq_lens`: other lengths than the case's; `launch`: further
    keywords of `decode_attention`."""
    b = case.batch
    decode_attention(
        case.q,
        b.kv.pool.k_buffers[0],
        b.kv.pool.v_buffers[0],
        b.kv.req_to_token.req_to_token,
        b.req_pool_indices,
        b.seq_lens if seq_lens is None else seq_lens,
        out,
        case.layer.scaling,
        splits,
        **launch,
    )


def triton_extend(case: Case, **launch) -> torch.Tensor:
    """The Triton extend kernel on an extend case (its new q/k/v over layer 0 of its pool, its
    table and rows), as a new tensor; `launch`: further keywords of `extend_attention`."""
    b = case.batch
    out = torch.full_like(case.q, float("nan"))
    extend_attention(
        case.q,
        case.k,
        case.v,
        out,
        b.kv.pool.k_buffers[0],
        b.kv.pool.v_buffers[0],
        b.kv.req_to_token.req_to_token,
        b.req_pool_indices,
        b.prefix_lens,
        b.extend_seq_lens,
        b.extend_start_loc,
        int(b.extend_seq_lens.max()),
        case.layer.scaling,
        **launch,
    )
    return out
