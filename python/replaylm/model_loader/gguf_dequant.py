"""GGUF tensors dequantised by torch on the device the model loads on.

The raw blocks go to the device as they are in the file (a Q4 tensor a seventh of its float32
size) and the device turns them into float32: on a GPU that is a few elementwise kernels instead
of seconds of numpy on the host. F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are done here, with the same
arithmetic as gguf-py's `gguf.quants` (so the same float32 values); any other type goes through
`gguf.quants.dequantize` on the host first.
"""

from __future__ import annotations

import gguf
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_FLOATS = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_BLOCKS = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """Float32 tensor of `shape` (outermost dimension first) on `device` from `raw`, the uint8
    bytes of a tensor of type `qtype` on the host."""
    if qtype not in _FLOATS and qtype not in _BLOCKS:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        rows = raw.numpy().reshape(-1, shape[-1] // block_size * type_size)
        host = gguf.quants.dequantize(rows, qtype)
        return torch.from_numpy(host).reshape(shape).to(device)
    data = raw.to(device, non_blocking=True)
    if qtype in _FLOATS:  # copied even when float32: on the host `data` is the file's mapping
        return data.view(_FLOATS[qtype]).reshape(shape).to(torch.float32, copy=True)
    return _dequantize_blocks(data, qtype).reshape(shape)


def _dequantize_blocks(data: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """[n_blocks, 32] float32 values of Q8_0, Q4_0 or Q4_1 blocks: an fp16 scale `d` (Q4_1: then
    an fp16 minimum `m`), then 32 int8 values (Q8_0) or 32 4-bit ones, two to a byte, the low
    nibbles holding the block's first 16 and the high nibbles its last 16."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    blocks = data.view(-1, block_bytes)
    d = _fp16_column(blocks, 0)
    # in place on the one float32 result: a large tensor's temporaries would cost device memory
    if qtype == GGMLQuantizationType.Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)
    quants = blocks[:, -16:]
    nibbles = torch.cat((quants & 0x0F, quants >> 4), dim=1)
    if qtype == GGMLQuantizationType.Q4_0:
        return nibbles.view(torch.int8).sub_(8).float().mul_(d)
    return nibbles.float().mul_(d).add_(_fp16_column(blocks, 2))


def _fp16_column(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 value at byte `offset` of every block, as a float32 column [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()
