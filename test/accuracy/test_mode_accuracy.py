"""The all-mode accuracy suite (needs CUDA; skipped elsewhere): every decode x prefill cell the
resolver accepts on CUDA, each through its own real server, asked gsm8k (the first 200 questions,
5-shot) and mgsm_en (all 250), greedy, and compared with the eager server's run of the same
questions (mode_compare.py): accuracy inside eager's 95% interval, >= 98% of completions identical
to eager's, no failed request. The eager cell itself is compared too: the run-to-run noise floor.

    python -m pytest test/accuracy/test_mode_accuracy.py -v -rA [-k "tc_piecewise"]

Every server runs with `--deterministic` (batch-invariant kernels): a server's batches depend on
request timing, and without batch invariance the same question rounds differently in another
batch, so two runs differ whatever the mode (pilot, tc_piecewise vs eager, both bit-equal per
batch: 77.5% of gsm8k completions identical). `REPLAYLM_ACCURACY_DETERMINISTIC=0` runs the
default kernels instead (accuracy comparable, identity not expected).

Model: the built-in SmolLM2-135M-Instruct, or `$REPLAYLM_ACCURACY_MODEL` (any --model-path).
Eval data: the copy shipped with the package. The summary JSON (for
`benchmark/plot.py --accuracy`) of the cells that ran goes to `$REPLAYLM_ACCURACY_JSON`, else
`$OUT/accuracy.json` when `$OUT` is set, else `accuracy.json` in the temporary directory. The eager
reference runs once per session of this module, whatever `-k` selects; servers run one at a time.
`$REPLAYLM_ACCURACY_SERVER_ARGS` adds launch_server flags to every server: e.g.
`--max-total-tokens 262144` caps each server's KV cache, so that one session per decode mode
(`-k "full-"`, each with its own `$REPLAYLM_ACCURACY_JSON`) runs side by side on one GPU
(`--mem-fraction-static` would count the other sessions' memory as used).
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from replaylm.cuda_graph_modes import MODES
from replaylm.device.gpu_probe import GpuFacts
from replaylm.model_executor.cuda_graph.config import CudaGraphConfigError
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_loader.builtin_models import DEFAULT_MODEL
from replaylm.server_args import ServerArgs

from eval_runs import EvalSpec, ask
from mode_compare import Comparison, EvalRun, compare, write_summary
from server_process import start_server

pytestmark = pytest.mark.gpu

SPECS = (EvalSpec("gsm8k", 200, 5, 512), EvalSpec("mgsm_en", 250, None, 512))
PARALLEL = 128  # requests in flight, and the server's --max-running-requests
EAGER = ("disabled", "disabled")
MODEL = os.environ.get("REPLAYLM_ACCURACY_MODEL", DEFAULT_MODEL)
DETERMINISTIC = os.environ.get("REPLAYLM_ACCURACY_DETERMINISTIC", "1") != "0"
EXTRA_SERVER_ARGS = shlex.split(os.environ.get("REPLAYLM_ACCURACY_SERVER_ARGS", ""))


def accepted_cells() -> list[tuple[str, str]]:
    """(decode, prefill) of every cell `--cuda-graph-mode` accepts on CUDA, default settings."""
    cells = []
    for decode in MODES:
        for prefill in MODES:
            modes = json.dumps({"decode": decode, "prefill": prefill})
            args = ServerArgs(device="cuda", cuda_graph_mode=modes)
            try:
                resolve_engine_config(args, GpuFacts(1, 2**37))
            except CudaGraphConfigError:
                continue
            cells.append((decode, prefill))
    return cells


def summary_path() -> Path:
    if os.environ.get("REPLAYLM_ACCURACY_JSON"):
        return Path(os.environ["REPLAYLM_ACCURACY_JSON"])
    return Path(os.environ.get("OUT") or tempfile.gettempdir()) / "accuracy.json"


def ask_cell(cell: tuple[str, str]) -> dict[str, EvalRun]:
    """Start a server in `cell`'s modes, ask it every eval of SPECS, stop it."""
    decode, prefill = cell
    server = start_server(
        "--model-path",
        MODEL,
        "--cuda-graph-mode",
        json.dumps({"decode": decode, "prefill": prefill}),
        "--max-running-requests",
        str(PARALLEL),
        *(["--deterministic"] if DETERMINISTIC else []),
        *EXTRA_SERVER_ARGS,
        device="cuda",
    )
    try:
        return {
            spec.name: ask(server.base_url, spec, f"{decode}/{prefill}", PARALLEL) for spec in SPECS
        }
    finally:
        server.stop()


@pytest.fixture(scope="module")
def comparisons() -> Iterator[list[Comparison]]:
    """Every comparison the module makes; written as the summary JSON at its end."""
    made: list[Comparison] = []
    yield made
    if made:
        write_summary(summary_path(), MODEL, made)
        print(f"\naccuracy summary: {summary_path()}")


@pytest.fixture(scope="module")
def eager() -> dict[str, EvalRun]:
    """The reference: each eval's run on the all-eager server."""
    return ask_cell(EAGER)


@pytest.mark.parametrize("cell", accepted_cells(), ids="-".join)
def test_cell_agrees_with_eager(cell, eager, comparisons):
    runs = ask_cell(cell)
    made = [compare(runs[name], eager[name]) for name in eager]
    comparisons += made
    for c in made:
        print(c.line())
    problems = [f"{c.eval_name}: {p}" for c in made for p in c.problems]
    assert not problems, problems
