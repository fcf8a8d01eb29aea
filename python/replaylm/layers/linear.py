"""Linear layers without initialisation (weights are loaded or filled by the loader), and the
choice of matmul kernel (`--small-batch-matmul`, `--deterministic`)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from replaylm.layers.activation import SiluAndMul
from replaylm.layers.kernels import converted, use_triton_kernels

# cublas: F.linear; triton: the skinny split-K kernel for inputs of at most 16 rows (F.linear
# above); invariant: the skinny kernel for every input, K unsplit (rows independent of the batch);
# auto: per layer, triton or cublas (`MatmulLayer.auto_matmul`)
MATMULS = ("cublas", "triton", "invariant", "auto")
# auto: layer weights up to this size take the skinny kernel, larger ones cuBLAS (the LM head,
# `LogitsProcessor`, takes the skinny kernel at every size): docs/tuning.md, "Split-K skinny matmul"
AUTO_SKINNY_MAX_BYTES = 64 * 2**20


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    matmul: str,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` by the `matmul` kernel (one of MATMULS); the Triton ones only on the
    Triton route (`use_triton_kernels`), `F.linear` elsewhere. `out_dtype`: the result's dtype
    (default x's; the skinny kernel writes it from its float32 sums, saving a conversion).
    `out`: a contiguous tensor of the result's shape and dtype to write (and return) instead of
    a new one (eager calls)."""
    if _takes_triton_matmul(x, matmul):
        from replaylm.layers.kernels import ops

        return ops.linear(
            x, weight, bias, all_rows=matmul == "invariant", out_dtype=out_dtype, out=out
        )
    return converted(F.linear(x, weight, bias), out_dtype, out)


def _takes_triton_matmul(x: torch.Tensor, matmul: str) -> bool:
    return matmul != "cublas" and use_triton_kernels(x)


class MatmulLayer(nn.Module):
    """A layer whose matmul kernel `set_matmul` chooses (`matmul`, one of MATMULS less auto)."""

    matmul = "cublas"

    def auto_matmul(self) -> str:
        """The kernel `--small-batch-matmul auto` picks for this layer: the skinny one."""
        return "triton"


def set_matmul(model: nn.Module, matmul: str) -> Counter[str]:
    """Make every MatmulLayer of `model` use `matmul` (one of MATMULS; auto: each layer's
    `auto_matmul`); when any takes "triton", reserve the split-K workspace on the model's device
    now. Returns how many layers take each kernel."""
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {', '.join(MATMULS)}, not '{matmul}'")
    chosen: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, MatmulLayer):
            module.matmul = module.auto_matmul() if matmul == "auto" else matmul
            chosen[module.matmul] += 1
    weight = next(model.parameters(), None)
    if chosen["triton"] and weight is not None and use_triton_kernels(weight):
        from replaylm.layers.kernels.skinny_matmul import reserve_workspace

        reserve_workspace(weight.device)
    return chosen


class Linear(MatmulLayer):
    """`y = x W^T (+ b)` with `W` `[out, in]`, allocated uninitialised on the default device."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.matmul)

    def auto_matmul(self) -> str:
        """The skinny kernel for weights up to AUTO_SKINNY_MAX_BYTES, cuBLAS above."""
        size = self.weight.numel() * self.weight.element_size()
        return "triton" if size <= AUTO_SKINNY_MAX_BYTES else "cublas"


class MergedLinear(Linear):
    """Several projections of one input fused into one matmul (QKV, gate-up).

    `shards` maps a shard name to its output width, in output order; `load_shard` copies one
    checkpoint tensor into its rows.
    """

    def __init__(self, input_size: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shards.values()), bias)
        self.shard_sizes = dict(shards)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor, name: str) -> None:
        """Copy `tensor` (named `name` in the checkpoint) into `shard`'s rows of `param`."""
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for '{name}': checkpoint has {tuple(tensor.shape)}, "
                f"model expects {expected}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output back into its shards, in order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class GateUpLinear(MergedLinear):
    """The gate and up projections followed by SiluAndMul: `[..., in] -> [..., inter]`,
    `silu(x Wg^T) * (x Wu^T)`. On the skinny kernel (up to 16 rows, or `invariant`) one launch,
    SiluAndMul in its epilogue; otherwise the matmul, then SiluAndMul's own kernel."""

    def __init__(self, input_size: int, intermediate_size: int) -> None:
        super().__init__(input_size, {"gate": intermediate_size, "up": intermediate_size})
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _takes_triton_matmul(x, self.matmul):
            from replaylm.layers.kernels import ops

            return ops.linear(
                x, self.weight, self.bias, all_rows=self.matmul == "invariant", gated_silu=True
            )
        return self.act(super().forward(x))
