"""Random weights of the right shapes for benchmarks (`--load-format dummy`)."""

from __future__ import annotations

import torch
from torch import nn

from replaylm.distributed.sharding import full_shape, local_part
from replaylm.layers.layernorm import RMSNorm

DUMMY_STD = 0.02  # HF's usual initializer_range: keeps activations and logits finite


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, biases 0, every other weight N(0, 0.02^2), reproducible from `seed`.
    A tensor-parallel rank draws each sharded weight whole, as one rank would, and keeps its
    part: every tensor-parallel size gets the same model."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in norm_params:
                param.fill_(1.0)
            elif name == "bias":
                param.zero_()
            else:
                gen = generators.setdefault(
                    param.device, torch.Generator(device=param.device).manual_seed(seed)
                )
                shape = full_shape(module, name)
                if shape == tuple(param.shape):
                    param.normal_(0.0, DUMMY_STD, generator=gen)
                else:
                    whole = param.new_empty(shape).normal_(0.0, DUMMY_STD, generator=gen)
                    param.copy_(local_part(module, name, whole))
