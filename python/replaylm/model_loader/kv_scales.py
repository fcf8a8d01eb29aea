"""An FP8 checkpoint's KV-cache scales: taken out of the weights as they stream to the model,
then set on the attention layers for an fp8 KV cache (`--kv-cache-dtype fp8_e4m3`), or left
unused (a cache in the model's dtype holds K and V as they are).

The names read are vLLM's: `*.self_attn.k_scale` / `v_scale` (AutoFP8, llm-compressor, vLLM's
own, also under `self_attn.attn.`), ModelOpt's `*.self_attn.k_proj.k_scale` / `v_proj.v_scale`,
compressed-tensors' `*.self_attn.k_proj.output_scale` / `v_proj.output_scale`, and the older
`*.self_attn.kv_scale`, one scale for both. A scale is the dequantizing one: K ~ cached * k_scale.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from replaylm.layers.attention.layer import Attention

logger = logging.getLogger(__name__)

# checkpoint name suffix -> the scales it gives ("k", "v" or both), longer suffixes first
_SUFFIXES = (
    (".k_proj.output_scale", "k"),
    (".v_proj.output_scale", "v"),
    (".k_proj.k_scale", "k"),
    (".v_proj.v_scale", "v"),
    (".k_scale", "k"),
    (".v_scale", "v"),
    (".kv_scale", "kv"),
)


def _kv_scale_of(name: str) -> tuple[str, str] | None:
    """(the name of the module holding it, "k" / "v" / "kv") when checkpoint tensor `name` is
    a KV-cache scale, else None."""
    for suffix, which in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def without_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], found: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` less the KV-cache scales, which are put in `found` by name as they pass."""
    for name, tensor in weights:
        if _kv_scale_of(name) is None:
            yield name, tensor
        else:
            found[name] = tensor


def set_kv_scales(model: nn.Module, found: dict[str, torch.Tensor]) -> None:
    """Set each attention layer's `k_scale` / `v_scale` from the checkpoint's scales `found`
    (`without_kv_scales`), and log how many layers got them (the others keep 1.0). ValueError
    naming a scale no attention layer owns, or one not positive and finite."""
    modules = dict(model.named_modules())
    layers: set[int] = set()
    for name, tensor in found.items():
        match = _kv_scale_of(name)
        assert match is not None  # `found` holds what `without_kv_scales` matched
        owner, which = match
        layer = _attention(modules.get(owner))
        if layer is None:
            raise ValueError(
                f"checkpoint tensor '{name}' is a KV-cache scale of no attention layer"
            )
        value = _scale(name, tensor)
        if "k" in which:
            layer.k_scale = value
        if "v" in which:
            layer.v_scale = value
        layers.add(layer.layer_id)
    total = sum(isinstance(m, Attention) for m in modules.values())
    if layers:
        logger.info(
            "fp8 KV cache: the checkpoint's k_scale / v_scale for %d of %d attention layers "
            "(the others 1.0)",
            len(layers),
            total,
        )
    else:
        logger.warning(
            "fp8 KV cache: the checkpoint has no KV-cache scales; every layer's k_scale and "
            "v_scale are 1.0, so K and V saturate at +-448"
        )


def _attention(module: nn.Module | None) -> Attention | None:
    """The attention layer a scale's owner names: the layer itself, or its `attn`."""
    if isinstance(module, Attention):
        return module
    attn = getattr(module, "attn", None)
    return attn if isinstance(attn, Attention) else None


def _scale(name: str, tensor: torch.Tensor) -> float:
    """A scale tensor as the layer's one float: per-head scales (several elements) give their
    largest, which saturates no head earlier than its own would."""
    value = float(tensor.float().max())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint tensor '{name}' is a KV-cache scale of {value}, not > 0")
    return value
