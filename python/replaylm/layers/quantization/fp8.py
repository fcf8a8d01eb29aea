"""FP8 e4m3 quantization of weights and activations, and back.

A weight `[..., N, K]` is held as e4m3 values `q` and float32 scales, `w ~ q * scale`: one scale
per output channel (`[..., N]`) or per `[bn, bk]` block (`[..., ceil(N/bn), ceil(K/bk)]`, the
last row and column of blocks possibly ragged, as checkpoints hold them). A block's scale is its
amax over 448, e4m3's largest value; a channel's is the one of least round-trip squared error
among `CLIP_RATIOS` of that (its few largest values saturate, the rest get a finer grid). An
activation `[T, K]` is quantized per token (a row) or per token and `group`-column group, or with
one static scale.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# the least amax a scale is taken from: an all-zero row or block quantizes to zeros, not NaN
MIN_AMAX = 1e-12
# elements of a weight quantized at once: its float32 temporaries stay at 64 MiB
CHUNK_ELEMENTS = 1 << 24
# a channel's scales tried, as fractions of amax / 448 (the first wins ties): on the built-in
# SmolLM2 this halves the perplexity cost of FP8 weights against amax alone
CLIP_RATIOS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9)

Block = tuple[int, int]


class QuantizedRows(NamedTuple):
    """An activation already quantized per token by the kernel that made it (RMSNorm's or
    SiluAndMul's: `QuantizesFor`), for the per-channel FP8 matmul that reads it: e4m3 `q`
    `[T, K]`, float32 `scale` `[T, 1]`, and `dtype`, the dtype it was quantized from (the
    matmul's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


# what an FP8 linear takes: an activation, or one quantized ahead of it
Activation = torch.Tensor | QuantizedRows


class TakesQuantizedRows(Protocol):
    @property
    def takes_quantized_rows(self) -> bool: ...


class QuantizesFor:
    """A layer whose output may come quantized per token, from its own launch, for the one
    layer it feeds (`quantizes_for(layer)`): `quantizes()` says whether to, outside
    torch.compile's tracing, once that layer takes a quantized input (`takes_quantized_rows`,
    known when its weights are loaded)."""

    _feeds: tuple[TakesQuantizedRows, ...] = ()  # a tuple: not a submodule of the layer

    def quantizes_for(self, layer: TakesQuantizedRows) -> None:
        self._feeds = (layer,)

    def quantizes(self) -> bool:
        return (
            not torch.compiler.is_compiling()  # first: the rest is not for tracing
            and len(self._feeds) == 1
            and self._feeds[0].takes_quantized_rows
        )


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32, already divided by its scale) rounded to e4m3, saturating at +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight(w: torch.Tensor, block: Block | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` `[..., N, K]` (any float dtype) as (e4m3 `[..., N, K]`, float32 scales): per output
    channel `[..., N]` (`block` None) or per block `[..., ceil(N/bn), ceil(K/bk)]`. Done a few
    rows at a time on `w`'s device, so that quantizing a weight as it loads costs little memory
    beyond the weight itself."""
    n, k = w.shape[-2:]
    flat = w.reshape(-1, n, k)
    q = torch.empty(flat.shape, dtype=FP8_DTYPE, device=w.device)
    step = _chunk_rows(k, block)
    scales = []
    for index, matrix in enumerate(flat):
        parts = []
        for start in range(0, n, step):
            rows, scale = _quantize_rows(matrix[start : start + step], block)
            q[index, start : start + step] = rows
            parts.append(scale)
        scales.append(torch.cat(parts))
    scale = torch.stack(scales)
    return q.reshape(w.shape), scale.reshape(*w.shape[:-2], *scale.shape[1:])


def _chunk_rows(k: int, block: Block | None) -> int:
    """Rows quantized at once: about CHUNK_ELEMENTS, whole blocks of rows."""
    rows = block[0] if block is not None else 1
    return max(rows, CHUNK_ELEMENTS // max(k, 1) // rows * rows)


def _quantize_rows(w: torch.Tensor, block: Block | None) -> tuple[torch.Tensor, torch.Tensor]:
    if block is None:
        return _quantize_channels(w.float())
    blocks = _blocks(w.float(), block)  # [nbn, bn, nbk, bk]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = to_fp8(blocks / scale[:, None, :, None])
    return q.flatten(0, 1).flatten(1, 2)[: w.shape[0], : w.shape[1]], scale


def _quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `w` (float32) to e4m3, each with the scale of `CLIP_RATIOS` whose round trip has
    the least squared error."""
    amax = w.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    best_q, best_scale, best_error = _channel_round_trip(w, amax * CLIP_RATIOS[0] / FP8_MAX)
    for ratio in CLIP_RATIOS[1:]:
        q, scale, error = _channel_round_trip(w, amax * ratio / FP8_MAX)
        better = error < best_error
        best_q = torch.where(better[:, None], q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_q, best_scale


def _channel_round_trip(
    w: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 rows of `w` by their `scale`, `scale`, each row's squared round-trip error)."""
    q = to_fp8(w / scale[:, None])
    return q, scale, (q.float() * scale[:, None] - w).square().sum(dim=-1)


def _blocks(w: torch.Tensor, block: Block) -> torch.Tensor:
    """`w` `[N, K]` zero-padded to whole blocks, as `[N/bn, bn, K/bk, bk]` (zeros leave each
    ragged block's amax as it is)."""
    bn, bk = block
    n, k = w.shape
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))
    return padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)


def expand_block_scale(scale: torch.Tensor, block: Block, n: int, k: int) -> torch.Tensor:
    """Block scales `[..., nbn, nbk]` as one scale per element of an `[..., n, k]` weight."""
    rows = scale.repeat_interleave(block[0], dim=-2)[..., :n, :]
    return rows.repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: Block | None) -> torch.Tensor:
    """The float32 weight `q * scale` of `quantize_weight`'s pair."""
    if block is None:
        return q.float() * scale.unsqueeze(-1)
    return q.float() * expand_block_scale(scale, block, *q.shape[-2:])


def quantize_activation(
    x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[T, K]` as (e4m3 `[T, K]`, float32 scales): per token `[T, 1]` (`group` None), per
    token and `group`-column group `[T, ceil(K/group)]` (the last group possibly shorter), or
    with `static_scale` (a layer's input scales, whose largest is taken: a fused layer's shards
    share one quantized input) as `[T, 1]`. Scales are contiguous."""
    if static_scale is not None:
        scale = static_scale.max().float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return to_fp8(x.float() / scale), scale
    if group is None:
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX) / FP8_MAX
        return to_fp8(x.float() / scale), scale
    groups = _groups(x.float(), group)  # [T, G, group]
    scale = groups.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = to_fp8(groups / scale[..., None]).flatten(1)[:, : x.shape[1]]
    return q, scale


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    padded = F.pad(x, (0, -x.shape[1] % group))
    return padded.reshape(x.shape[0], -1, group)


def dequantize_activation(
    q: torch.Tensor, scale: torch.Tensor, group: int | None = None
) -> torch.Tensor:
    """The float32 activation of `quantize_activation`'s pair (`group`: as quantized)."""
    if group is None or scale.shape[1] == 1:
        return q.float() * scale
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]
