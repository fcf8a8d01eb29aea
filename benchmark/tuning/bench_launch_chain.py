"""What one dependent kernel launch costs inside a CUDA graph: the floor under a decode step's
chain of launches, whatever each kernel computes.

    python benchmark/tuning/bench_launch_chain.py [--launches 480] [--programs 1 132 528]
                                                  [--json out.json]

Captures `--launches` Triton kernels back to back, each reading what the one before it wrote
and writing what the next one reads (one word a program: a dependent chain, as a decode step's
kernels are), with PDL and without, at each `--programs` grid size, and replays the graph. The
cost per launch is the replay time over the launch count. A decode step of L launches that
reads B bytes cannot take less than about `B / bandwidth + L * cost`: the launch's ramp (the
grid's start, the first dependent load, the drain) is paid once per kernel in a chain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch
import triton
import triton.language as tl

from replaylm.layers.kernels.pdl import wait_for_producers

from common import cuda_time_ms, write_json


@triton.jit
def _link_kernel(In, Out, USE_PDL: tl.constexpr):
    """Out[pid] = In[pid] + 1, after the kernel before it has finished."""
    wait_for_producers(USE_PDL)
    pid = tl.program_id(0)
    tl.store(Out + pid, tl.load(In + pid) + 1)


def launch_chain(a: torch.Tensor, b: torch.Tensor, launches: int, pdl: bool) -> None:
    """`launches` kernels of one program per element of `a` (int32, `b` alike), alternately
    a -> b and b -> a, each adding one to what the one before wrote."""
    launch = {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}
    for i in range(launches):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        _link_kernel[(a.numel(),)](src, dst, **launch)


def chain_us(launches: int, programs: int, pdl: bool) -> float:
    """Microseconds per launch of a captured chain of `launches` dependent kernels."""
    a = torch.zeros(programs, dtype=torch.int32, device="cuda")
    b = torch.zeros_like(a)
    launch_chain(a, b, launches, pdl)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_chain(a, b, launches, pdl)
    return cuda_time_ms(graph.replay, warmup=5, repeat=30) * 1e3 / launches


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launches", type=int, default=480)
    parser.add_argument("--programs", type=int, nargs="+", default=[1, 132, 528])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'programs':>8} {'pdl':>5} {'us per launch':>13}")
    for programs in args.programs:
        for pdl in (False, True):
            us = chain_us(args.launches, programs, pdl)
            rows.append({"programs": programs, "pdl": pdl, "us_per_launch": round(us, 3)})
            print(f"{programs:8d} {pdl!s:>5} {us:13.3f}")
    if args.json:
        write_json(args.json, {"launches": args.launches, "rows": rows})


if __name__ == "__main__":
    main()
