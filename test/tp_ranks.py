"""Tensor-parallel ranks for CPU tests: one spawned process per rank (gloo on loopback), each
building a ModelRunner for its rank; what rank 0 computes comes back to the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replaylm.distributed.launch import run_on_ranks
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.server_args import ServerArgs

from model_parity import scripted_logits

RANK_TIMEOUT_S = 120.0


def runner_logits(args: ServerArgs, rank: int) -> list[np.ndarray]:
    """`scripted_logits` of a ModelRunner of `args` at tensor-parallel rank `rank` (as arrays:
    tensors would cross the process boundary as shared memory of an exited process)."""
    if args.device == "cpu":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    runner = ModelRunner(args, tp_rank=rank)
    logits = scripted_logits(runner, prompt_lens=(5, 40, 17), first_decode_id=200)
    return [t.cpu().numpy() for t in logits]


def run_ranks(fn: Callable[[ServerArgs, int], Any], args: ServerArgs) -> Any:
    """`fn(args, rank)` on `args.tp_size` ranks; rank 0's result. Fails if a rank fails or
    does not finish in RANK_TIMEOUT_S."""
    return run_on_ranks(fn, args, RANK_TIMEOUT_S)[0]
