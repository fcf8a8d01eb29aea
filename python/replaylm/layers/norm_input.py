"""An RMSNorm left to the layer that reads its output: at a decode step's few rows the matmul
after a norm can normalize its own input (each program its rows), which saves the norm's launch
(`skinny_matmul(norm=...)`). `RMSNorm` hands such a layer a `PendingNorm` where the layer says
it takes one (`leaves_norm_to`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class NormInput:
    """The norm a matmul applies to its input first: its `weight` `[K]` and `eps`, and with
    `residual` (the input's shape and dtype) the sum `input + residual` normalized instead and
    written to `residual_out` (contiguous, the input's shape), as `rms_norm` writes the new
    residual."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


class PendingNorm(NamedTuple):
    """`x` yet to be normalized by `norm`, by the layer that reads it."""

    x: torch.Tensor
    norm: NormInput
