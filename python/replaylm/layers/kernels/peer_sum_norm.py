"""The one-shot sum over peer memory, fused with the residual add and RMSNorm that follow it in
every decoder layer: one launch instead of NCCL's all-reduce plus the norm's kernel.

Lamport-style, no barrier: each rank stores its rows straight into its own region of every
rank's buffer (NVLink stores), then polls its local buffer until no element of any rank's region
still holds the empty mark, -0.0's bit pattern (a sender turns its -0.0 into +0.0, which sums
alike). A reader marks what it read empty again, in the same launch. Two slots alternate between
consecutive calls (see `PeerAllReduce`): a rank writes a slot again only after every rank has
taken part in the call between, which each rank enters after its previous launch (read and
re-marked) has ended.

Every rank adds the ranks' rows in rank order in float32, so every rank gets the same bits. The
sum is rounded to the dtype (what an all-reduce returns), then the add and norm match
`kernels.rmsnorm`: `s = x + residual` rounded (the new residual), `weight * (s * rsqrt(mean(s^2)
+ eps)).to(dtype)`.

The launcher takes the buffers as addresses, so it runs over any memory every rank can reach:
torch's symmetric memory on GPUs, shared memory in Triton's interpreter (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.distributed.peer_all_reduce import EMPTY_MARK, SLOTS, PeerAllReduce
from replaylm.layers.kernels import pdl_launch
from replaylm.layers.kernels.pdl import wait_for_producers


@triton.jit(do_not_specialize=["n_rows"])
def _peer_sum_norm_kernel(
    X,
    R,
    W,
    Out,
    ResOut,
    Regions,
    n_rows,
    stride_x,
    stride_r,
    eps,
    region_elems,
    H: tl.constexpr,
    RANK: tl.constexpr,
    RANKS: tl.constexpr,
    BITS: tl.constexpr,
    EMPTY: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producers(USE_PDL)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < H
    first = tl.program_id(0)
    step = tl.num_programs(0)
    # every row of this program goes out before any wait: a program then waits only on the
    # same program of the other ranks, which never waits before it has sent
    for row in range(first, n_rows, step):
        x = tl.load(X + row * stride_x + cols, mask=in_row, other=0.0)
        bits = x.to(BITS, bitcast=True)
        bits = tl.where(bits == EMPTY, tl.zeros_like(bits), bits)  # -0.0 -> +0.0 (the mark)
        for rank in tl.static_range(RANKS):
            region = tl.load(Regions + rank).to(tl.pointer_type(BITS))
            tl.store(region + RANK * region_elems + row * H + cols, bits, mask=in_row)
    local = tl.load(Regions + RANK).to(tl.pointer_type(BITS))
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    for row in range(first, n_rows, step):
        total = tl.zeros([BLOCK_D], tl.float32)
        for rank in tl.static_range(RANKS):
            src = local + rank * region_elems + row * H + cols
            bits = tl.load(src, mask=in_row, other=0, volatile=True)
            while tl.sum((bits == EMPTY).to(tl.int32), axis=0) > 0:
                bits = tl.load(src, mask=in_row, other=0, volatile=True)
            total += bits.to(X.dtype.element_ty, bitcast=True).to(tl.float32)
            tl.store(src, tl.full([BLOCK_D], EMPTY, BITS), mask=in_row)
        summed = total.to(X.dtype.element_ty)
        r = tl.load(R + row * stride_r + cols, mask=in_row, other=0.0)
        s = (summed.to(tl.float32) + r.to(tl.float32)).to(ResOut.dtype.element_ty)
        tl.store(ResOut + row * H + cols, s, mask=in_row)
        sf = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
        normed = (sf * rstd).to(s.dtype).to(tl.float32)
        tl.store(Out + row * H + cols, (w * normed).to(Out.dtype.element_ty), mask=in_row)


def launch_peer_sum_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    regions: torch.Tensor,
    region_elems: int,
    rank: int,
    max_programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rmsnorm(sum + residual) * weight, sum + residual)`, `sum` the ranks' `x` (`[rows, H]`,
    rows contiguous). `regions`: on the device, int64, one address per rank: where that rank's
    buffer of this call's slot begins (read as integers of the width of `x`); rank q's rows go at
    `q * region_elems` in it (marked empty before the first call). Every rank calls this with
    the same shapes; `max_programs` at most what every rank's device keeps resident at once."""
    n_rows, width = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x)
    block_d = triton.next_power_of_2(width)
    if n_rows:
        _peer_sum_norm_kernel[(min(n_rows, max_programs),)](
            x,
            residual,
            weight,
            out,
            res_out,
            regions,
            n_rows,
            x.stride(0),
            residual.stride(0),
            eps,
            region_elems,
            H=width,
            RANK=rank,
            RANKS=regions.numel(),
            BITS=tl.int16 if x.element_size() == 2 else tl.int32,
            EMPTY=EMPTY_MARK[x.element_size()],
            BLOCK_D=block_d,
            num_warps=min(max(block_d // 512, 1), 8),
            **pdl_launch(),
        )
    return out, res_out


def peer_sum_add_rms_norm(
    peer: PeerAllReduce,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    site: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rmsnorm(sum + residual) * weight, sum + residual)`, `sum` the ranks' `x`, over `peer`'s
    buffer in the slot of `site`'s parity."""
    return launch_peer_sum_norm(
        x,
        residual,
        weight,
        eps,
        peer.regions[site % SLOTS],
        peer.region_elems,
        peer.rank,
        peer.max_programs,
    )
