"""An FP8 model around its loading: the layers a checkpoint's ignore list leaves unquantized
re-made in the model's dtype before the weights load, the checks of what the device runs, and
the start-up log's account of what is FP8 and what is not."""

from __future__ import annotations

import re

import torch
from torch import nn

from replaylm.layers.linear import Linear
from replaylm.layers.moe.layer import FusedMoE
from replaylm.layers.quantization.config import Fp8Config
from replaylm.layers.quantization.fp8_linear import SKINNY_ROWS
from replaylm.layers.vocab_embedding import VocabRows
from replaylm.models.llama import LlamaForCausalLM

# torch._scaled_mm's row-wise scaling: Ada and Hopper (compute capability 8.9) or newer, and a
# GEMM's K and N multiples of 16
SCALED_MM_CAPABILITY = (8, 9)
SCALED_MM_MULTIPLE = 16


def _fp8_layers(model: nn.Module) -> list[tuple[str, Linear | FusedMoE]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (Linear, FusedMoE)) and m.quant is not None
    ]


@torch.no_grad()
def leave_ignored_unquantized(model: LlamaForCausalLM, quant: Fp8Config) -> list[str]:
    """Re-make in the default dtype every FP8 layer of `model` whose checkpoint names `quant`
    ignores (called where the model was built, before its weights load); their names.
    ValueError when a fused layer's shards (or a layer's experts) are ignored in part: one
    weight holds them all."""
    left = []
    for name, layer in _fp8_layers(model):
        names = model.checkpoint_names(name)
        ignored = [n for n in names if quant.ignores(n)]
        if not ignored:
            continue
        if len(ignored) < len(names):
            raise ValueError(
                f"the checkpoint's quantization config leaves {ignored[0]} unquantized but not "
                f"{next(n for n in names if n not in ignored)}, which {name} holds with it"
            )
        if isinstance(layer, Linear):
            layer.make_weights(None)
        else:
            layer.make_weights(None, layer.hidden_size)
        left.append(name)
    return left


def check_fp8_device(model: nn.Module, device: torch.device) -> None:
    """On CUDA, what the FP8 layers need: a GPU of compute capability 8.9+, and for per-channel
    scales (torch._scaled_mm) sizes that are multiples of 16, for block scales a block k that
    is a power of two of 16 or more (ValueError). The experts run Triton kernels of any size.
    The CPU emulates every layout."""
    layers = _fp8_layers(model)
    if device.type != "cuda" or not layers:
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < SCALED_MM_CAPABILITY:
        raise ValueError(
            f"FP8 weights need a GPU of compute capability 8.9+ (torch._scaled_mm); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    for name, layer in layers:
        if not isinstance(layer, Linear):
            continue
        block_k = None if layer.block_size is None else layer.block_size[1]
        if block_k is not None and (block_k < 16 or block_k & (block_k - 1)):
            raise ValueError(
                f"FP8 block scales on CUDA need a block k that is a power of two of 16 or more "
                f"(the block-scaled GEMM's k step); {name} has {block_k}"
            )
        if layer.block_size is None and any(
            size % SCALED_MM_MULTIPLE for size in layer.weight.shape
        ):
            raise ValueError(
                f"FP8 on CUDA needs weights whose sizes are multiples of {SCALED_MM_MULTIPLE} "
                f"(torch._scaled_mm); {name} is {list(layer.weight.shape)}"
            )


def describe_fp8(
    model: nn.Module, quant: Fp8Config, device: torch.device, ignored: list[str]
) -> str:
    """The start-up log's line: the scheme, how many layers are FP8, which stay in the model's
    dtype (layer numbers folded: `model.layers.*.mlp.gate` x 48), and what runs the matmuls."""
    fp8 = _fp8_layers(model)
    experts = sum(isinstance(layer, FusedMoE) for _, layer in fp8)
    kept: dict[str, list[str]] = {}  # layer numbers folded -> the names
    for name, m in model.named_modules():
        if isinstance(m, VocabRows) or (isinstance(m, (Linear, FusedMoE)) and m.quant is None):
            kept.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(name)
    unquantized = ", ".join(
        f"{folded} x {len(names)}" if len(names) > 1 else names[0] for folded, names in kept.items()
    )
    if device.type != "cuda":
        runs = f"emulated on the {device.type.upper()} (dequantized per matmul)"
    elif quant.block_size is not None:
        runs = "a Triton block-scaled GEMM"
    else:
        runs = (
            f"a Triton kernel with FP8 dots up to {SKINNY_ROWS} rows (decode), torch._scaled_mm "
            "with row-wise scales above"
        )
    left = f"; left unquantized by the checkpoint's ignore list: {len(ignored)}" if ignored else ""
    blocks = f" and {experts} expert blocks" if experts else ""
    return (
        f"{quant.describe()}: {len(fp8) - experts} linear layers{blocks} in FP8{left}; "
        f"unquantized: {unquantized or 'none'}; FP8 matmuls {runs}"
    )
