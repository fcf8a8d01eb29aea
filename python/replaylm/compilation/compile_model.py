"""Compile a model's forward for tc_piecewise: `compiled_forward(model, options)`.

The compiled callable is `(input_ids [T], positions [T]) -> final hidden states [T, H]`, traced
once by torch.compile(fullgraph=True) with the token dimension unbacked-dynamic (one compile
serves every token count, 1 included: no 0/1 specialisation, no shape guards) and the attention
custom op left opaque; with `kernels="fused"` (the default) the fused layer kernels enter the
graph as opaque custom ops too, so every piece computes the eager model's numbers and the compiler
fuses only what lies between them. The caller must hold `attention_context` open while calling
it (each call starts a forward pass in it: `start_forward`). Failures to compile are raised as
TcPiecewiseCompileError, never hidden by a fallback.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from replaylm.compilation.piecewise_backend import PiecewiseBackend
from replaylm.layers.attention.ops import start_forward
from replaylm.layers.kernels import kernels_in_compiled_code

if TYPE_CHECKING:
    from replaylm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # one Dynamo cache entry per compiled model; tests build many models

KERNEL_CHOICES = ("fused", "native")


@dataclass(frozen=True)
class TcPiecewiseOptions:
    """`compiler` of the pieces (`piecewise_backend.COMPILERS`); `kernels`: "fused" keeps the
    Triton kernels (norms, rope, SiluAndMul, the skinny matmul) whole inside the pieces, "native"
    traces the layers' torch code so that the compiler derives its own fusions."""

    compiler: str = "inductor"
    kernels: str = "fused"

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(
                f"tc_piecewise kernels must be one of {', '.join(KERNEL_CHOICES)}, "
                f"not '{self.kernels}'"
            )


_compiled: weakref.WeakKeyDictionary[nn.Module, dict[TcPiecewiseOptions, CompiledForward]] = (
    weakref.WeakKeyDictionary()
)


class TcPiecewiseCompileError(RuntimeError):
    """torch.compile could not compile the model for tc_piecewise."""


def split_ops() -> tuple[object, ...]:
    """The ops tc_piecewise splits at (they run eagerly between the captured pieces)."""
    return (torch.ops.replaylm.attention.default, torch.ops.replaylm.attention)


class CompiledForward:
    """`model.forward_hidden` compiled with the piecewise backend; compiles on the first call
    (`compile_seconds` is the whole first call: tracing and compiling)."""

    def __init__(self, model: LlamaForCausalLM, options: TcPiecewiseOptions) -> None:
        self.model = model
        self.options = options
        self.backend = PiecewiseBackend(options.compiler, split_ops())
        self.compile_seconds: float | None = None
        self._fn = torch.compile(self._hidden, backend=self.backend, fullgraph=True)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward_hidden(input_ids, positions, None)

    @property
    def is_compiled(self) -> bool:
        return self.compile_seconds is not None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        start_forward()
        # fresh copies (two small kernels, in the first captured piece): a decode graph's inputs
        # are views of one packed buffer, at storage offsets that vary with the shape, and
        # Dynamo specialises an offset of 0 or 1 (a recompile, refused after the first compile)
        input_ids, positions = input_ids.clone(), positions.clone()
        with kernels_in_compiled_code(self.options.kernels == "fused"):
            if self.is_compiled:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._fn(input_ids, positions)
            return self._compile(input_ids, positions)

    def _compile(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for t in (input_ids, positions):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        start = time.perf_counter()
        try:
            with torch._dynamo.config.patch(
                recompile_limit=limit, fail_on_recompile_limit_hit=True
            ):
                out = self._fn(input_ids, positions)
        except Exception as e:  # any failure: reported with what to do instead
            raise TcPiecewiseCompileError(_explain(e)) from e
        self.compile_seconds = time.perf_counter() - start
        split = self.backend.split
        assert split is not None  # the backend has split the graph it compiled
        logger.info(
            "tc_piecewise: compiled the forward in %.1f s (%s, %s kernels): %d attention calls, "
            "%d compute pieces%s",
            self.compile_seconds,
            self.options.compiler,
            self.options.kernels,
            len(split.pieces) - len(split.compute_pieces),
            len(split.compute_pieces),
            f", {self.backend.cache_hits} from Inductor's cache"
            if self.backend.compiler == "inductor"
            else "",
        )
        return out


def _explain(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    detail = "; ".join(lines[:3]) if lines else type(error).__name__
    return (
        f"tc_piecewise: torch.compile could not compile the model ({type(error).__name__}: "
        f"{detail}). Use the 'breakable' mode for this phase, which needs no compiler."
    )


def set_compile_cache_dir(path: str) -> None:
    """Make Inductor (and the Triton kernels it builds) cache compiled pieces under `path`, so
    that the next start with the same directory skips most compiling."""
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)


def compiled_forward(model: LlamaForCausalLM, options: TcPiecewiseOptions) -> CompiledForward:
    """The model's one CompiledForward for `options` (both phases share it)."""
    per_model = _compiled.setdefault(model, {})
    if options not in per_model:
        per_model[options] = CompiledForward(model, options)
    return per_model[options]
