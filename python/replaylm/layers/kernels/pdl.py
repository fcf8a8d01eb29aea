"""Programmatic dependent launch (PDL, Hopper and newer) inside the Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running
(its programs get resident and do work that needs nothing from earlier kernels: index math,
constant weights); `wait_for_producers` is where it waits for the earlier kernel to end and its
writes to be visible. Correct for a chain of kernels when every program of every PDL-launched
kernel calls it before it reads anything an earlier kernel wrote or writes anything an earlier
kernel reads: each kernel then ends after the one before it, so the order is transitive. Kernels
launched without PDL (torch, cuBLAS, Inductor's) keep the usual stream order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_producers(USE_PDL: tl.constexpr):
    """With `USE_PDL`: wait until the previous kernel has finished (its writes visible), then let
    the next PDL kernel begin launching. A no-op without."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
