"""Random weights of the right shapes for benchmarks (`--load-format dummy`)."""

from __future__ import annotations

import torch
from torch import nn

from replaylm.distributed.sharding import full_shape, local_part
from replaylm.layers.layernorm import RMSNorm
from replaylm.layers.linear import Linear
from replaylm.layers.moe.layer import FusedMoE
from replaylm.layers.quantization.fp8 import FP8_MAX, is_fp8, quantize_weight

DUMMY_STD = 0.02  # HF's usual initializer_range: keeps activations and logits finite
# static FP8 input scales of dummy weights: activations up to 8 in magnitude stay unclipped
DUMMY_INPUT_SCALE = 8.0 / FP8_MAX


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, biases 0, every other weight N(0, 0.02^2), reproducible from `seed`.
    A tensor-parallel rank draws each sharded weight whole, as one rank would, and keeps its
    part: every tensor-parallel size gets the same model. An FP8 weight is that draw quantized
    as the layer holds it (its scales with it); static input scales are DUMMY_INPUT_SCALE."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in norm_params:
                param.fill_(1.0)
            elif name == "bias":
                param.zero_()
            elif name.endswith("input_scale"):
                param.fill_(DUMMY_INPUT_SCALE)
            elif not name.endswith("weight_scale"):  # weight scales come with their weights
                gen = generators.setdefault(
                    param.device, torch.Generator(device=param.device).manual_seed(seed)
                )
                _fill(module, name, param, gen)


def _fill(module: nn.Module, name: str, param: nn.Parameter, gen: torch.Generator) -> None:
    """Parameter `name` of `module`: this rank's part of a whole N(0, 0.02^2) draw, quantized
    with its scales when it is an FP8 weight."""
    shape = full_shape(module, name)
    if not is_fp8(param):
        if shape == tuple(param.shape):
            param.normal_(0.0, DUMMY_STD, generator=gen)
        else:
            whole = param.new_empty(shape).normal_(0.0, DUMMY_STD, generator=gen)
            param.copy_(local_part(module, name, whole))
        return
    assert isinstance(module, (Linear, FusedMoE)) and module.quant is not None
    whole = torch.empty(shape, device=param.device).normal_(0.0, DUMMY_STD, generator=gen)
    q, scale = quantize_weight(whole, module.quant.block_size)
    param.copy_(local_part(module, name, q))
    getattr(module, f"{name}_scale").copy_(local_part(module, f"{name}_scale", scale))
