"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from replaylm.layers.kernels import use_triton_kernels


class RMSNorm(nn.Module):
    """`y = x / rms(x) * weight`, computed in float32 and cast back (as HF Llama does).

    With `residual`, first `x = x + residual` and the sum is returned as the new residual.
    On the Triton route (`use_triton_kernels`) one fused kernel does it all.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton_kernels(x):
            from replaylm.layers.kernels.ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)
