"""Every decode x prefill CUDA-graph cell against the all-eager cell on one checkpoint: greedy
tokens equal, but where they part at a near-tie (bf16 rounding differs between batch shapes),
and the graphs really replayed. Shared by the GPU tests of model families and precisions."""

from __future__ import annotations

import gc
import json
from typing import Any

import torch

from replaylm.cuda_graph_modes import DISABLED, modes_serving
from replaylm.entrypoints.engine import Engine

from model_parity import divergence_gaps

NEAR_TIE = 0.5  # top-2 logit gap under which bf16 noise may flip a greedy choice
CELLS = [
    (decode, prefill)
    for decode in (*modes_serving("decode"), DISABLED)
    for prefill in (*modes_serving("prefill"), DISABLED)
]


def cell_engine(path: str, decode: str, prefill: str, **args: Any) -> Engine:
    """A bf16 CUDA engine of `path` in one cell (`args`: more engine arguments)."""
    return Engine(
        model_path=path,
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=8192,
        max_running_requests=32,
        cuda_graph_mode=json.dumps({"decode": decode, "prefill": prefill}),
        **args,
    )


def random_prompts(vocab: int, count: int = 24) -> list[list[int]]:
    """`count` prompts of 5 to 44 tokens, the same on every call."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5 + 7 * i % 40 for i in range(count)]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy(engine: Engine, prompts: list[list[int]], tokens: int = 16) -> list[list[int]]:
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]


def assert_cell_matches_eager(
    eager: Engine,
    prompts: list[list[int]],
    want: list[list[int]],
    path: str,
    cell: tuple[str, str],
    **args: Any,
) -> None:
    """`path`'s engine in `cell` (decode, prefill; `args` as `cell_engine`'s) gives `eager`'s
    greedy tokens `want` on `prompts`, its graphs replayed in each phase they cover."""
    engine = cell_engine(path, *cell, **args)
    try:
        got = greedy(engine, prompts)
        phases = engine.runner.forward_stats.phases
        for phase, mode in zip(("decode", "prefill"), cell, strict=True):
            if mode != DISABLED:
                assert phases[phase].graph > 0, phase
    finally:
        engine.shutdown()
        del engine
        # the next cell's engine sizes its KV cache from the free memory: give this one's back
        gc.collect()
        torch.cuda.empty_cache()
    gaps = divergence_gaps(eager.runner, prompts, got, want)
    assert all(gap <= NEAR_TIE for gap in gaps.values()), gaps
    assert len(gaps) <= 1, gaps
