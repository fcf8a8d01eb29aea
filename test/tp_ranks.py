"""Tensor-parallel ranks for CPU tests: one spawned process per rank (gloo on loopback), each
building a ModelRunner for its rank; what rank 0 computes comes back to the test."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaylm.distributed.launch import run_on_ranks
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.server_args import ServerArgs

from model_parity import scripted_logits

RANK_TIMEOUT_S = 120.0

# a dummy Llama whose heads, KV heads and MLP divide by 2 and 3, and whose vocabulary does not
# (the last rank's rows are padding)
DUMMY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 331,
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 12,
    "num_key_value_heads": 6,
    "max_position_embeddings": 256,
}


def cpu_args(model_path: str | Path, **extra: object) -> ServerArgs:
    """ServerArgs of a small float32 CPU runner of `model_path` (`extra` overrides)."""
    base: dict[str, object] = {
        "device": "cpu",
        "dtype": "float32",
        "max_total_tokens": 512,
        "max_running_requests": 8,
        "context_length": 256,
    }
    return ServerArgs(model_path=str(model_path), **{**base, **extra})  # type: ignore[arg-type]


def write_dummy_config(folder: Path, **changes: Any) -> Path:
    """DUMMY_CONFIG (with `changes`) as `folder`/config.json: a model path for dummy weights,
    without a tokenizer."""
    config = folder / "config.json"
    config.write_text(json.dumps({**DUMMY_CONFIG, **changes}))
    return config


def runner_logits(args: ServerArgs, rank: int) -> list[np.ndarray]:
    """`scripted_logits` of a ModelRunner of `args` at tensor-parallel rank `rank` (as arrays:
    tensors would cross the process boundary as shared memory of an exited process)."""
    if args.device == "cpu":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    runner = load_model_runner(resolve_engine_config(args), tp_rank=rank)
    logits = scripted_logits(runner, prompt_lens=(5, 40, 17), first_decode_id=200)
    return [t.cpu().numpy() for t in logits]


def run_ranks(fn: Callable[[ServerArgs, int], Any], args: ServerArgs) -> Any:
    """`fn(args, rank)` on `args.tp_size` ranks; rank 0's result. Fails if a rank fails or
    does not finish in RANK_TIMEOUT_S."""
    return run_on_ranks(fn, args, RANK_TIMEOUT_S)[0]
