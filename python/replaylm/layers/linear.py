"""Linear layers without initialisation (weights are loaded or filled by the loader), and the
choice of matmul kernel (`--small-batch-matmul`, `--deterministic`).

A layer built with an `Fp8Config` holds its weight in FP8 (e4m3) with float32 `weight_scale`s
(`layers/quantization/layout.py`: per output channel, or per block) and, for static
activations, `input_scale`s; its forward is `fp8_linear` whatever `set_matmul` chose (the
kernel choice is the unquantized layers').
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from replaylm.distributed.sharding import Shard
from replaylm.layers.activation import SiluAndMul
from replaylm.layers.kernels import cublas_linear, use_triton_kernels
from replaylm.layers.quantization.config import Fp8Config
from replaylm.layers.quantization.fp8 import FP8_DTYPE, Activation, QuantizesFor
from replaylm.layers.quantization.fp8_linear import fp8_linear, gated_fp8_linear, takes_skinny
from replaylm.layers.quantization.layout import as_held, scale_shape, scale_shard, whole_blocks

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
    Triton route (`use_triton_kernels`), cuBLAS elsewhere (`cublas_linear`). `out_dtype`: the
    result's dtype (default x's; the skinny kernel writes it from its float32 sums, and cuBLAS
    a float32 result itself, each saving a conversion).
    `out`: a contiguous tensor of the result's shape and dtype to write (and return) instead of
    a new one (eager calls)."""
    if _takes_triton_matmul(x, matmul):
        from replaylm.layers.kernels import ops

        return ops.linear(
            x, weight, bias, all_rows=matmul == "invariant", out_dtype=out_dtype, out=out
        )
    return cublas_linear(x, weight, bias, out_dtype, out)


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
    `auto_matmul`), and reserve the split-K workspace on the model's device now where the Triton
    kernels run (the skinny matmul's, FP8 layers' at decode rows, the MoE pair kernels'). Returns
    how many layers take each kernel ("fp8": the FP8 layers, which always run `fp8_linear` and
    are left as they are)."""
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {', '.join(MATMULS)}, not '{matmul}'")
    chosen: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, Linear) and module.quant is not None:
            chosen["fp8"] += 1
        elif isinstance(module, MatmulLayer):
            module.matmul = module.auto_matmul() if matmul == "auto" else matmul
            chosen[module.matmul] += 1
    weight = next(model.parameters(), None)
    if weight is not None and use_triton_kernels(weight):
        from replaylm.layers.kernels.skinny_matmul import reserve_workspace

        reserve_workspace(weight.device)
    return chosen


class Linear(MatmulLayer):
    """`y = x W^T (+ b)` with `W` `[out, in]`, allocated uninitialised on the default device (in
    FP8 with its scales when `quant` is given).

    `shard`: under tensor parallelism, where this rank's weight lies in the checkpoint's (dim 0:
    a column-parallel layer, its output split over the ranks; dim 1: `RowParallelLinear`); None:
    the whole weight."""

    weight_scale: nn.Parameter | None
    input_scale: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        shard: Shard | None = None,
        quant: Fp8Config | None = None,
        num_input_scales: int = 1,
    ) -> None:
        """`num_input_scales`: the checkpoint tensors whose static input scales the layer holds
        (one each; a fused layer's shards)."""
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.shard = shard
        self.num_input_scales = num_input_scales
        self.make_weights(quant)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def make_weights(self, quant: Fp8Config | None) -> None:
        """(Re)allocate the weight: in the default dtype, or (`quant`) in FP8 with its scales.
        The loader calls it with None for a layer the checkpoint leaves unquantized."""
        self.quant = quant
        shape = (self.output_size, self.input_size)
        if quant is None:
            self.weight = nn.Parameter(torch.empty(shape))
            self.weight_scale = self.input_scale = None
            return
        block = quant.block_size
        self.weight = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(scale_shape(*shape, block), dtype=torch.float32), requires_grad=False
        )
        self.input_scale = None
        if quant.static_activations:
            self.input_scale = nn.Parameter(
                torch.empty(self.num_input_scales, dtype=torch.float32), requires_grad=False
            )
        scale_shard(self.shard, block)  # a rank's part of block scales: whole blocks, or an error

    @property
    def block_size(self) -> tuple[int, int] | None:
        return None if self.quant is None else self.quant.block_size

    @property
    def takes_quantized_rows(self) -> bool:
        """Whether the layer takes its input quantized ahead of it (`QuantizedRows`): FP8
        weights with per-channel scales and dynamic per-token activation scales."""
        return (
            self.weight_scale is not None and self.block_size is None and self.input_scale is None
        )

    def forward(self, x: Activation) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(
                x,
                self.weight,
                self.weight_scale,
                self.block_size,
                self.bias,
                input_scale=self.input_scale,
            )
        assert isinstance(x, torch.Tensor)  # only FP8 layers are fed quantized rows
        return linear(x, self.weight, self.bias, self.matmul)

    def _shard_of(self, name: str) -> Shard | None:
        if name == "weight_scale":
            return scale_shard(self.shard, self.block_size)
        # a row-parallel bias is whole on every rank: it is added once, after the sum
        row_bias = name == "bias" and self.shard is not None and self.shard.dim
        return None if name == "input_scale" or row_bias else self.shard

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `full` of parameter `name`."""
        shard = self._shard_of(name)
        return full if shard is None else shard.take(full)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint's shape of parameter `name`."""
        shard, local = self._shard_of(name), getattr(self, name).shape
        return tuple(local) if shard is None else shard.full_shape(local)

    def as_held(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint tensor `tensor` of parameter `name` in the form the layer holds it
        (`layout.as_held`: scales float32, per-tensor ones repeated per channel)."""
        return as_held(name, tensor, self.full_shape("weight")[0], self.block_size)

    def auto_matmul(self) -> str:
        """The skinny kernel for weights up to AUTO_SKINNY_MAX_BYTES, cuBLAS above."""
        size = self.weight.numel() * self.weight.element_size()
        return "triton" if size <= AUTO_SKINNY_MAX_BYTES else "cublas"


class MergedLinear(Linear):
    """Several projections of one input fused into one matmul (QKV, gate-up).

    `shards` maps a shard name to its output width, in output order; `load_shard` copies one
    checkpoint tensor into its rows (or, for its scales, into theirs: per-channel scales at the
    shard's rows, block scales at its rows' blocks, so every shard but the last must be whole
    blocks; one static input scale per shard). `sources`: under tensor parallelism, where each
    shard's rows lie in its checkpoint tensor (None: all of them).
    """

    def __init__(
        self,
        input_size: int,
        shards: dict[str, int],
        bias: bool = False,
        sources: dict[str, Shard] | None = None,
        quant: Fp8Config | None = None,
    ) -> None:
        super().__init__(
            input_size, sum(shards.values()), bias, quant=quant, num_input_scales=len(shards)
        )
        self.shard_sizes = dict(shards)
        self.sources = sources
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = offset
            offset += size
        if self.block_size is not None:
            self._placement("weight_scale")  # every shard on whole blocks, or an error

    def _placement(self, name: str) -> dict[str, tuple[int, int, Shard | None]]:
        """Per shard, in order: its rows of parameter `name` (start, count) and where they lie
        in its checkpoint tensor (None: all of it)."""
        if name == "input_scale":
            return {shard: (index, 1, None) for index, shard in enumerate(self.shard_sizes)}
        block = self.block_size if name == "weight_scale" else None
        placed = {}
        for shard, size in self.shard_sizes.items():
            start = self.shard_offsets[shard]
            source = None if self.sources is None else self.sources[shard]
            if block is None:
                placed[shard] = (start, size, source)
                continue
            if start % block[0]:
                raise ValueError(
                    f"FP8 block scales: the fused {'/'.join(self.shard_sizes)} layer's {shard} "
                    f"rows start at {start}, inside a block of {block[0]} (block size "
                    f"{list(block)}): every shard but the last must be whole blocks"
                )
            rows = -(-size // block[0])
            held = None if source is None else whole_blocks(source, block)
            placed[shard] = (start // block[0], rows, held)
        return placed

    def load_shard(self, name: str, shard: str, tensor: torch.Tensor, ckpt_name: str) -> None:
        """Copy the checkpoint tensor `tensor` (named `ckpt_name`) of `shard`'s parameter
        `name` into its place."""
        param = getattr(self, name)
        start, size, source = self._placement(name)[shard]
        weight_rows = self.shard_sizes[shard] if self.sources is None else self.sources[shard].full
        tensor = as_held(name, tensor, weight_rows, self.block_size)
        if source is not None:
            if tensor.shape[0] != source.full:
                raise ValueError(
                    f"shape mismatch for '{ckpt_name}': checkpoint has {tuple(tensor.shape)}, "
                    f"model expects {source.full_shape(tensor.shape)}"
                )
            tensor = source.take(tensor)
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for '{ckpt_name}': checkpoint has {tuple(tensor.shape)}, "
                f"model expects {expected}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(tensor)

    def _sources(self, name: str) -> list[Shard] | None:
        """Where each shard's rows of parameter `name` lie in its checkpoint tensor, in order
        (None: the fused tensor is the checkpoint's)."""
        placed = self._placement(name).values()
        sources = [source for _, _, source in placed if source is not None]
        return sources if len(sources) == len(placed) else None

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a fused checkpoint-shaped tensor: each shard's part, in order."""
        sources = self._sources(name)
        if sources is None:
            return full
        wholes = full.split([s.full for s in sources])
        return torch.cat([s.take(w) for s, w in zip(sources, wholes, strict=True)])

    def full_shape(self, name: str) -> tuple[int, ...]:
        local, sources = getattr(self, name).shape, self._sources(name)
        if sources is None:
            return tuple(local)
        return (sum(s.full for s in sources), *local[1:])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output back into its shards, in order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class GateUpLinear(MergedLinear, QuantizesFor):
    """The gate and up projections followed by SiluAndMul: `[..., in] -> [..., inter]`,
    `silu(x Wg^T) * (x Wu^T)`. On the skinny kernel (up to 16 rows, or `invariant`; FP8
    per-channel weights where `fp8_linear` takes it) one launch, SiluAndMul in its epilogue;
    otherwise the matmul (FP8 weights: `fp8_linear`), then SiluAndMul's own kernel, or (the
    Triton route, `quantizes_for` a layer that takes it) SiluAndMul with the per-token
    quantization in one launch."""

    def __init__(
        self,
        input_size: int,
        intermediate_size: int,
        source: Shard | None = None,
        quant: Fp8Config | None = None,
    ) -> None:
        """`intermediate_size`: this rank's; `source`: where its rows lie in the checkpoint's
        gate and up projections (None: all of them)."""
        sources = None if source is None else {"gate": source, "up": source}
        super().__init__(
            input_size,
            {"gate": intermediate_size, "up": intermediate_size},
            sources=sources,
            quant=quant,
        )
        self.act = SiluAndMul()

    def forward(self, x: Activation) -> Activation:  # type: ignore[override]
        if (
            isinstance(x, torch.Tensor)
            and self.quant is None
            and _takes_triton_matmul(x, self.matmul)
        ):
            from replaylm.layers.kernels import ops

            return ops.linear(
                x, self.weight, self.bias, all_rows=self.matmul == "invariant", gated_silu=True
            )
        if self.weight_scale is not None and takes_skinny(x, self.block_size):
            return gated_fp8_linear(
                x, self.weight, self.weight_scale, self.bias, input_scale=self.input_scale
            )
        y = super().forward(x)
        if use_triton_kernels(y) and self.quantizes():
            from replaylm.layers.quantization.fp8_kernels import silu_and_mul_quantize

            return silu_and_mul_quantize(y)
        return self.act(y)


class RowParallelLinear(Linear):
    """A linear whose input is split over the tensor-parallel ranks (the attention output over
    heads, the MLP's over its intermediate columns): each rank multiplies its columns of the
    weight and returns its partial sums. The RMSNorm that follows sums them over the ranks
    (its `sum_site`), so the sum can share a launch with the residual add and the norm. Built
    only with more than one rank."""

    def __init__(self, shard: Shard, output_size: int, quant: Fp8Config | None = None) -> None:
        super().__init__(shard.size, output_size, False, shard, quant)
