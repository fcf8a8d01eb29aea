"""Where the ranks of one machine meet, and one function run on every tensor-parallel rank of
this machine, each in a spawned process (one GPU per rank on CUDA): the offline way to drive
ModelRunners of several ranks in step, as benchmarks and tests do. Each rank builds its own
runner from the same arguments. No torch here: the HTTP front end picks the meeting address."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import socket
from collections.abc import Callable
from typing import Any, Protocol, TypeVar


class RankArgs(Protocol):
    """What `run_on_ranks` reads of the arguments it hands every rank (a dataclass)."""

    tp_size: int
    dist_init_addr: str | None


ArgsT = TypeVar("ArgsT", bound=RankArgs)


def free_loopback_addr() -> str:
    """`127.0.0.1:PORT` with a port free now, where the ranks of one machine can meet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rank_main(fn: Callable[[Any, int], Any], args: Any, rank: int, results: Any) -> None:
    results.put((rank, fn(args, rank)))


def run_on_ranks(
    fn: Callable[[ArgsT, int], Any], args: ArgsT, timeout_s: float = 600.0
) -> list[Any]:
    """`fn(args, rank)` in `args.tp_size` spawned processes meeting on a free loopback port
    (whatever `args.dist_init_addr` says); every rank's result, by rank. `fn` must be a module's
    top-level function and its result picklable. RuntimeError naming the ranks' exit codes when
    a rank fails or all do not finish within `timeout_s`."""
    args = dataclasses.replace(args, dist_init_addr=free_loopback_addr())  # type: ignore[type-var]
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
