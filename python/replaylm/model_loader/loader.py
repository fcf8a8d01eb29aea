"""Model loading: resolve the path, read the config, build the model, fill its weights.

Accepted `model_path`: a built-in name (see builtin_models), an HF folder (config.json +
safetensors), a single `.gguf` file, or — with `load_format="dummy"` — a folder or a `.json` file
holding only a config.

FP8: the checkpoint's `quantization_config`, or `--quantization fp8`, resolves to an
`Fp8Config` (`layers/quantization/config.py`) before the model is built; its linear layers and
experts are built in FP8 (those the checkpoint's ignore list names re-made in the model's dtype),
FP8 tensors load as they are, and a higher-precision weight is quantized as it arrives, on the
device, so that memory peaks about one such weight above the FP8 model. The checkpoint's
KV-cache scales go to the attention layers for an fp8 KV cache, else unused (`kv_scales`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from replaylm.distributed.parallel_state import shows_progress
from replaylm.layers.quantization.config import resolve_quantization
from replaylm.model_loader.dummy_weights import fill_dummy_weights
from replaylm.model_loader.formats import LOAD_FORMATS
from replaylm.model_loader.fp8_model import (
    check_fp8_device,
    describe_fp8,
    leave_ignored_unquantized,
)
from replaylm.model_loader.gguf_loader import (
    count_gguf_tensors,
    iter_gguf_weights,
    read_gguf_config,
)
from replaylm.model_loader.kv_scales import set_kv_scales, without_kv_scales
from replaylm.model_loader.safetensors_loader import (
    count_safetensors_tensors,
    iter_safetensors_weights,
    safetensors_files,
)
from replaylm.models.config import ModelConfig, is_hf_folder
from replaylm.models.llama import LlamaForCausalLM
from replaylm.models.registry import get_model_class
from replaylm.startup_stages import StartupStages, TimedIterator
from replaylm.utils import default_dtype

logger = logging.getLogger(__name__)


def is_gguf_file(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def load_model_config(model_path: str) -> ModelConfig:
    """Read the config of a resolved model path; clear errors for missing or unusable paths."""
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model path '{model_path}' does not exist")
    if is_gguf_file(model_path):
        logger.info("reading the GGUF metadata of %s (its vocabulary included)", model_path)
        return ModelConfig.from_dict(read_gguf_config(model_path))
    logger.info("reading the model config of %s", model_path)
    if is_hf_folder(model_path):
        return ModelConfig.from_json_file(os.path.join(model_path, "config.json"))
    if os.path.isfile(model_path) and model_path.endswith(".json"):
        return ModelConfig.from_json_file(model_path)
    raise ValueError(
        f"model path '{model_path}' is neither a folder with config.json, a .gguf file, "
        "nor a config .json file"
    )


def resolve_load_format(model_path: str, load_format: str) -> str:
    """`auto` -> gguf for .gguf files, else safetensors."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format '{load_format}'; choose one of {LOAD_FORMATS}")
    if load_format == "auto":
        return "gguf" if is_gguf_file(model_path) else "safetensors"
    return load_format


def load_model(
    path: str,
    config: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    stages: StartupStages | None = None,
    quantization: str | None = None,
    kv_scales: bool = False,
) -> LlamaForCausalLM:
    """Build the model of `config` on `device` in `dtype` and fill its weights from `path`
    (a resolved model path, see `resolve_model_path`); FP8 as the checkpoint's
    quantization_config or `quantization` (`--quantization`) says. `kv_scales`: the KV cache is
    fp8, so the checkpoint's KV-cache scales are set on the attention layers (else unused).
    `stages`: marked `model build`, then `weights read` (reading the checkpoint's tensors) and
    `weights to device` (filling the parameters with them; the two interleave, tensor by
    tensor)."""
    fmt = resolve_load_format(path, load_format)
    model_cls = get_model_class(config.architecture)
    quant = resolve_quantization(config.hf_config, quantization)
    config = dataclasses.replace(config, quantization=quant)
    logger.info(
        "building %s (%d layers) on %s in %s%s",
        config.architecture,
        config.num_hidden_layers,
        device,
        dtype,
        "" if quant is None else ", FP8 weights",
    )
    with torch.device(device), default_dtype(dtype):
        model = model_cls(config)
        ignored = [] if quant is None else leave_ignored_unquantized(model, quant)
    check_fp8_device(model, device)
    if stages is not None:
        stages.mark("model build")
    weights = TimedIterator[tuple[str, torch.Tensor]](())
    if fmt == "dummy":
        logger.info("filling random weights (seed %d)", seed)
        fill_dummy_weights(model, seed)
    else:
        tensors, count = _checkpoint_tensors(path, fmt, device)
        logger.info("loading %d %s tensors from %s", count, fmt, path)
        weights = TimedIterator(tensors)
        shown = shows_progress()
        found: dict[str, torch.Tensor] = {}
        progress = tqdm(
            weights, total=count, desc="Loading weights", unit="tensor", disable=not shown
        )
        model.load_weights(without_kv_scales(progress, found))
        if kv_scales:
            set_kv_scales(model, found)
    model.eval()
    if device.type == "cuda":
        # the copies are asynchronous (the stage waits for them), and the memory the checkpoint's
        # tensors were dequantized in goes back to the GPU, where the KV cache is sized from
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    if stages is not None:
        stages.mark_split("weights read", weights, "weights to device")
    logger.info(
        "loaded %s (%s, %s) from %s: %.1fM parameters, %s on %s",
        config.architecture,
        fmt,
        "tied" if config.tie_word_embeddings else "untied",
        path,
        sum(p.numel() for p in model.parameters()) / 1e6,
        dtype,
        device,
    )
    if quant is not None:
        logger.info("%s", describe_fp8(model, quant, device, ignored))
    return model


def _checkpoint_tensors(
    path: str, fmt: str, device: torch.device
) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """The checkpoint's (name, tensor) pairs and how many there are (for the progress bar);
    GGUF tensors come on `device`, dequantized there."""
    if fmt == "gguf":
        if not is_gguf_file(path):
            raise ValueError(f"--load-format gguf needs a .gguf file, got '{path}'")
        return iter_gguf_weights(path, device), count_gguf_tensors(path)
    if os.path.isfile(path):
        raise ValueError(f"--load-format safetensors needs an HF folder, got the file '{path}'")
    files = safetensors_files(path)
    return iter_safetensors_weights(files), count_safetensors_tensors(files)
