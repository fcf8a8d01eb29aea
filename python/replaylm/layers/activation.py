"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaylm.layers.kernels import use_triton_kernels


class SiluAndMul(nn.Module):
    """`[T, 2I] -> [T, I]`: silu(gate) * up, gate and up being the two halves of the input
    (one fused kernel on the Triton route, `use_triton_kernels`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton_kernels(x):
            from replaylm.layers.kernels.ops import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
