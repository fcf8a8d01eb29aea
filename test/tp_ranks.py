"""Tensor-parallel ranks for CPU tests: one spawned process per rank (gloo on loopback), each
building a ModelRunner for its rank; what rank 0 computes comes back to the test."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replaylm.model_executor.model_runner import ModelRunner
from replaylm.server_args import ServerArgs

from model_parity import scripted_logits
from server_process import free_port

RANK_TIMEOUT_S = 120.0


def runner_logits(args: ServerArgs, rank: int) -> list[np.ndarray]:
    """`scripted_logits` of a ModelRunner of `args` at tensor-parallel rank `rank` (as arrays:
    tensors would cross the process boundary as shared memory of an exited process)."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    runner = ModelRunner(args, tp_rank=rank)
    logits = scripted_logits(runner, prompt_lens=(5, 40, 17), first_decode_id=200)
    return [t.numpy() for t in logits]


def _rank_main(
    fn: Callable[[ServerArgs, int], Any], args: ServerArgs, rank: int, results: Any
) -> None:
    result = fn(args, rank)
    if rank == 0:
        results.put(result)


def run_ranks(fn: Callable[[ServerArgs, int], Any], args: ServerArgs) -> Any:
    """`fn(args, rank)` in `args.tp_size` spawned processes meeting on a free loopback port;
    rank 0's result. Fails if a rank fails or does not finish in RANK_TIMEOUT_S."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args.dist_init_addr = f"127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(fn, args, rank, results), daemon=True)
        for rank in range(args.tp_size)
    ]
    for proc in procs:
        proc.start()
    try:
        result = results.get(timeout=RANK_TIMEOUT_S)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"rank 0 gave no result; exit codes {codes}") from None
    finally:
        for proc in procs:
            proc.join(RANK_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    return result
