"""A batch's KV slots as one flat list, in request order: the page table of a paged-attention
library whose page holds one token (FlashInfer's `kv_indices` with page size 1).

Request i's slots `req_to_token[row_i, :len_i]` go to `out[indptr[i] : indptr[i] + len_i]`; one
program per request copies its row in blocks, so one launch serves any lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 512  # slots a program copies per iteration


@triton.jit
def _kv_indices_kernel(
    ReqToToken,
    RowOf,
    Lens,
    Indptr,
    Out,
    row_stride,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(RowOf + i).to(tl.int64)
    n = tl.load(Lens + i)
    start = tl.load(Indptr + i)
    for off in range(0, n, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < n
        slots = tl.load(ReqToToken + row * row_stride + cols, mask=ok)
        tl.store(Out + start + cols, slots, mask=ok)


def kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens: torch.Tensor,
    indptr: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill `out` (int32, at least `indptr[-1]` long) with every request's first `lens[i]` slots
    of its table row `req_pool_indices[i]`, request i from `indptr[i]` (`indptr` on the device,
    `[B + 1]`); returns `out`."""
    bs = req_pool_indices.shape[0]
    if bs:
        _kv_indices_kernel[(bs,)](
            req_to_token,
            req_pool_indices,
            lens,
            indptr,
            out,
            req_to_token.stride(0),
            BLOCK=_BLOCK,
        )
    return out
