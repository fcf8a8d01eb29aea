"""The quantization a model is served with, as one frozen `Fp8Config`: from config.json's
`quantization_config`, or from `--quantization fp8` for an unquantized checkpoint. replaylm runs
one scheme: FP8 e4m3 weights with float32 scales, activations quantized to FP8 at each matmul.

Checkpoint layouts read (the names vLLM and SGLang read):

- `quant_method: fp8` (DeepSeek, Qwen3-*-FP8, vLLM's and SGLang's own): with `weight_block_size`
  `[bn, bk]`, each weight's `weight_scale_inv` float32 `[ceil(N/bn), ceil(K/bk)]` and activations
  quantized per token and `bk`-column group; without it one `weight_scale` per tensor.
  `activation_scheme` dynamic (per token) or static (one `input_scale` per tensor, not with
  blocks); `ignored_layers` / `modules_to_not_convert` name the modules left unquantized.
- `quant_method: compressed-tensors` (llm-compressor's `float-quantized` FP8): one scheme of
  symmetric 8-bit float weights, strategy `channel` (`weight_scale` `[N, 1]`), `tensor` (`[1]`)
  or `block` (`block_structure`), input activations dynamic (per token, per token group for
  blocks) or static per tensor (`input_scale`); `ignore` lists names and `re:` patterns.

Anything else is a ValueError naming the scheme in one line. No torch here: the front end reads
`QUANTIZATION_METHODS` for the flag's choices.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)  # --quantization's choices
WEIGHT_SCALES = ("channel", "tensor", "block")
ACTIVATION_SCHEMES = ("dynamic", "static")
SUPPORTED = (
    "replaylm serves FP8 checkpoints (quant_method fp8, or compressed-tensors with symmetric "
    "8-bit float weights per channel, tensor or block) and --quantization fp8"
)


@dataclass(frozen=True)
class Fp8Config:
    """FP8 e4m3 weights with float32 scales: per output channel, per tensor (held per channel:
    each row of a fused layer keeps its own tensor's scale, no requantization) or per
    `block_size` `[rows, columns]` block; activations quantized `activations`: "dynamic" (per
    token, and per `block_size[1]`-column group with block scales) or "static" (the checkpoint's
    per-tensor `input_scale`). `ignored`: the checkpoint's names and patterns of modules left
    unquantized (`ignores`). `quantize_at_load`: the checkpoint is not FP8 (`--quantization
    fp8`): each weight is quantized as it loads. `method`: where the scheme came from, for the log;
    `kv_cache_scales`: the checkpoint carries FP8 KV-cache scales (read with `--kv-cache-dtype
    fp8_e4m3`, else unused)."""

    weight_scales: str
    activations: str = "dynamic"
    block_size: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()
    quantize_at_load: bool = False
    method: str = "fp8"
    kv_cache_scales: bool = False

    def __post_init__(self) -> None:
        if self.weight_scales not in WEIGHT_SCALES:
            raise ValueError(f"FP8 weight scales must be one of {WEIGHT_SCALES}")
        if self.activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"FP8 activations must be one of {ACTIVATION_SCHEMES}")
        if (self.weight_scales == "block") != (self.block_size is not None):
            raise ValueError("FP8 block scales and a block size go together")

    @property
    def static_activations(self) -> bool:
        return self.activations == "static"

    def ignores(self, name: str) -> bool:
        """Whether the checkpoint leaves module `name` (its checkpoint name) unquantized: an
        `ignored` entry names it or a module holding it (globs with `*` allowed; a bare name
        like `lm_head` or `mlp.gate` matches as a trailing part), or is a `re:` pattern that
        matches it from the start (compressed-tensors' rule)."""
        return any(_matches(pattern, name) for pattern in self.ignored)

    def describe(self) -> str:
        """One line for the start-up log: the scales, the activations and the source."""
        if self.block_size is not None:
            scales = f"{self.block_size[0]}x{self.block_size[1]} block scales"
        elif self.weight_scales == "tensor":
            scales = "per-tensor scales (held per channel)"
        else:
            scales = "per-channel scales"
        if self.static_activations:
            acts = "static per tensor (the checkpoint's input_scale)"
        elif self.block_size is not None:
            acts = f"dynamic per token and {self.block_size[1]}-column group"
        else:
            acts = "dynamic per token"
        source = (
            "quantized at load (--quantization fp8)"
            if self.quantize_at_load
            else f"from the checkpoint ({self.method})"
        )
        kv = "; KV-cache scales in the checkpoint (read with --kv-cache-dtype fp8_e4m3)"
        return f"FP8 e4m3 weights, {scales}, {source}; activations {acts}" + (
            kv if self.kv_cache_scales else ""
        )


def resolve_quantization(hf_config: dict[str, Any], flag: str | None) -> Fp8Config | None:
    """The quantization of a model whose config.json is `hf_config`, served with
    `--quantization flag`: the checkpoint's FP8 scheme (with or without the flag: it is FP8
    already), per-channel quantization at load for an unquantized checkpoint with `fp8`, or
    None. ValueError, one line naming the scheme, for any other quantization_config, or for the
    flag on a checkpoint quantized otherwise."""
    if flag is not None and flag not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}")
    quant = hf_config.get("quantization_config")
    if not quant:
        return None if flag is None else Fp8Config("channel", quantize_at_load=True)
    try:
        return parse_quantization_config(quant)
    except ValueError as err:
        if flag is None:
            raise
        raise ValueError(
            f"--quantization {flag} needs an unquantized or FP8 checkpoint: {err}"
        ) from err


def parse_quantization_config(quant: dict[str, Any]) -> Fp8Config:
    """An HF `quantization_config` as an Fp8Config; ValueError naming an unsupported scheme."""
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return _parse_fp8(quant)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(quant)
    raise _unsupported(f"quant_method '{quant.get('quant_method')}'")


def _unsupported(scheme: str) -> ValueError:
    return ValueError(f"unsupported quantization: {scheme}; {SUPPORTED}")


def _ignored(quant: dict[str, Any], *keys: str) -> tuple[str, ...]:
    return tuple(str(name) for key in keys for name in quant.get(key) or ())


def _block_size(value: Any, scheme: str) -> tuple[int, int]:
    """`[rows, columns]` (compressed-tensors also writes "128x128")."""
    parts = value.split("x") if isinstance(value, str) else value
    try:
        rows, cols = (int(p) for p in parts)
    except (TypeError, ValueError):
        raise _unsupported(f"{scheme} with block size {value!r}") from None
    if rows < 1 or cols < 1:
        raise _unsupported(f"{scheme} with block size {value!r}")
    return rows, cols


def _parse_fp8(quant: dict[str, Any]) -> Fp8Config:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"fp8 with fmt '{fmt}' (only e4m3)")
    activations = quant.get("activation_scheme") or "dynamic"
    if activations not in ACTIVATION_SCHEMES:
        raise _unsupported(f"fp8 with activation_scheme '{activations}'")
    block = quant.get("weight_block_size")
    block_size = None if block is None else _block_size(block, "fp8")
    if block_size is not None and activations == "static":
        raise _unsupported("fp8 with block scales and static activations")
    return Fp8Config(
        weight_scales="tensor" if block_size is None else "block",
        activations=activations,
        block_size=block_size,
        ignored=_ignored(quant, "ignored_layers", "modules_to_not_convert"),
    )


def _parse_compressed_tensors(quant: dict[str, Any]) -> Fp8Config:
    fmt = quant.get("format")
    if fmt not in (None, "float-quantized"):
        raise _unsupported(f"compressed-tensors format '{fmt}' (FP8 is float-quantized)")
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        raise _unsupported("compressed-tensors without config_groups")
    schemes = {_ct_scheme(group) for group in groups}
    if len(schemes) > 1:
        raise _unsupported("compressed-tensors with several schemes in config_groups")
    weight_scales, activations, block_size = schemes.pop()
    return Fp8Config(
        weight_scales=weight_scales,
        activations=activations,
        block_size=block_size,
        ignored=_ignored(quant, "ignore"),
        method="compressed-tensors",
        kv_cache_scales=bool(quant.get("kv_cache_scheme")),
    )


def _ct_scheme(group: dict[str, Any]) -> tuple[str, str, tuple[int, int] | None]:
    """One compressed-tensors config group as (weight scales, activations, block size)."""
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise _unsupported(f"compressed-tensors targets {targets} (FP8 targets Linear)")
    weights = group.get("weights") or {}
    kind = f"{weights.get('num_bits')}-bit {weights.get('type')}"
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise _unsupported(f"compressed-tensors with {kind} weights")
    if not weights.get("symmetric", True):
        raise _unsupported("compressed-tensors with asymmetric weights")
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_SCALES or weights.get("dynamic"):
        dynamic = " dynamic" if weights.get("dynamic") else ""
        raise _unsupported(f"compressed-tensors with{dynamic} weight strategy '{strategy}'")
    block_size = None
    if strategy == "block":
        block_size = _block_size(weights.get("block_structure"), "compressed-tensors")
    return strategy, _ct_activations(group.get("input_activations"), block_size), block_size


def _ct_activations(acts: dict[str, Any] | None, block_size: tuple[int, int] | None) -> str:
    """The activation scheme of compressed-tensors' `input_activations`: dynamic per token (or
    per tensor, taken per token: finer scales, never coarser; per group for block weights) or
    static per tensor."""
    if not acts:
        raise _unsupported("compressed-tensors without input_activations (weight-only FP8)")
    if (acts.get("num_bits"), acts.get("type")) != (8, "float"):
        raise _unsupported(
            f"compressed-tensors with {acts.get('num_bits')}-bit {acts.get('type')} activations"
        )
    if not acts.get("symmetric", True):
        raise _unsupported("compressed-tensors with asymmetric activations")
    strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    groups = block_size is not None and acts.get("group_size") == block_size[1]
    if dynamic and (strategy in ("token", "tensor") or (strategy == "group" and groups)):
        return "dynamic"
    if not dynamic and strategy == "tensor" and block_size is None:
        return "static"
    kind = "dynamic" if dynamic else "static"
    weights = "block" if block_size is not None else "channel or tensor"
    raise _unsupported(
        f"compressed-tensors with {kind} activation strategy '{strategy}' "
        f"(group size {acts.get('group_size')}) and {weights} weights"
    )


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    forms = (pattern, f"{pattern}.*", f"*.{pattern}", f"*.{pattern}.*")
    return any(fnmatch.fnmatchcase(name, form) for form in forms)
