"""Run one function on every tensor-parallel rank of this machine, each in a spawned process
(one GPU per rank on CUDA): the offline way to drive ModelRunners of several ranks in step, as
benchmarks and tests do. Each rank builds its own runner from the same ServerArgs."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
from collections.abc import Callable
from typing import Any

from replaylm.runtime.scheduler_process import with_dist_init_addr
from replaylm.server_args import ServerArgs

RankFn = Callable[[ServerArgs, int], Any]


def _rank_main(fn: RankFn, args: ServerArgs, rank: int, results: Any) -> None:
    results.put((rank, fn(args, rank)))


def run_on_ranks(fn: RankFn, args: ServerArgs, timeout_s: float = 600.0) -> list[Any]:
    """`fn(args, rank)` in `args.tp_size` spawned processes meeting on a free loopback port
    (whatever `args.dist_init_addr` says); every rank's result, by rank. `fn` must be a module's
    top-level function and its result picklable. RuntimeError naming the ranks' exit codes when
    a rank fails or all do not finish within `timeout_s`."""
    args = with_dist_init_addr(dataclasses.replace(args, dist_init_addr=None))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, args, rank, results), daemon=True)
        for rank in range(args.tp_size)
    ]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, result = results.get(timeout=timeout_s)
            got[rank] = result
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        missing = sorted(set(range(len(procs))) - set(got))
        raise RuntimeError(f"ranks {missing} gave no result; exit codes {codes}") from None
    finally:
        for proc in procs:
            proc.join(timeout_s if len(got) == len(procs) else 0.0)
            if proc.is_alive():
                proc.kill()
    return [got[rank] for rank in range(len(procs))]
