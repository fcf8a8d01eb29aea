"""PiecewiseBackend: the torch.compile backend of tc_piecewise.

Dynamo hands it the whole forward as one FX graph (with the token dimension symbolic). It splits
the graph at the opaque ops (`split.py`), compiles every compute piece once for all token counts,
and returns the split module, which calls the compiled pieces and the opaque ops in order. The
CUDA graphs come later: the tc_piecewise graph backend captures each piece per token bucket as one
segment of a breakable graph, the opaque ops running eagerly in between.

Compilers: `inductor` (fuses each piece's elementwise work into Triton kernels; structurally equal
pieces, e.g. the middle of every decoder layer, are compiled once and then come from Inductor's
cache) and `eager` (the traced pieces run as they are: the split without the fusion).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from tqdm import tqdm

from replaylm.compilation.split import SplitGraph, split_at_ops
from replaylm.distributed.parallel_state import shows_progress

logger = logging.getLogger(__name__)

COMPILERS = ("inductor", "eager")
# round at every dtype cast as eager does (Inductor keeps fused intermediates in float32 by
# default: more precise, but then bf16 logits drift from the eager model's)
INDUCTOR_CONFIG = {"emulate_precision_casts": True}


class _CompiledPiece(nn.Module):
    """A compiled callable in the place of the split module's submodule."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _canonical_placeholders(piece: fx.GraphModule) -> None:
    """Name inputs arg0, arg1, ... so that pieces equal but for their weights' names hash alike
    in Inductor's graph cache (one compile for all the middle pieces of a model)."""
    for i, node in enumerate(n for n in piece.graph.nodes if n.op == "placeholder"):
        node.name = node.target = f"arg{i}"
    piece.recompile()


class PiecewiseBackend:
    """`torch.compile(fn, backend=PiecewiseBackend(...))`. After the first call, `split` is the
    split graph and `compile_seconds` the time spent compiling its pieces."""

    def __init__(self, compiler: str, split_ops: Collection[object]) -> None:
        if compiler not in COMPILERS:
            raise ValueError(
                f"unknown tc_piecewise compiler {compiler!r}; choose from {', '.join(COMPILERS)}"
            )
        self.compiler = compiler
        self.split_ops = split_ops
        self.split: SplitGraph | None = None
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.num_compiles += 1
        split = self.split = split_at_ops(gm, self.split_ops)
        if self.compiler == "inductor":
            start = time.perf_counter()
            self._compile_pieces(split, example_inputs)
            self.compile_seconds = time.perf_counter() - start
        return split.module

    def _compile_pieces(self, split: SplitGraph, example_inputs: Sequence[Any]) -> None:
        """Run the split module on fake inputs; each compute piece is compiled by Inductor for
        the (symbolic) inputs it receives, then swapped in for its submodule."""
        from torch._dynamo.utils import counters
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import compile_fx

        compute = {p.name for p in split.compute_pieces}
        progress = tqdm(
            total=len(compute),
            desc="compiling tc_piecewise pieces (inductor)",
            unit="piece",
            disable=not shows_progress(),
        )
        hits_before = counters["inductor"]["fxgraph_cache_hit"]

        class Compiler(fx.Interpreter):
            def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
                out = super().call_module(target, args, kwargs)
                if target in compute:
                    piece = getattr(split.module, target)
                    _canonical_placeholders(piece)
                    compiled = compile_fx(piece, list(args), config_patches=INDUCTOR_CONFIG)
                    assert callable(compiled)  # compile_fx returns the compiled forward
                    setattr(split.module, target, _CompiledPiece(compiled))
                    progress.update()
                return out

        fake_mode = detect_fake_mode(example_inputs)
        assert fake_mode is not None, "Dynamo hands a backend fake example inputs"
        with progress, fake_mode:
            fake_inputs = [
                fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                for t in example_inputs
            ]
            Compiler(split.module).run(*fake_inputs)
        self.cache_hits = counters["inductor"]["fxgraph_cache_hit"] - hits_before
