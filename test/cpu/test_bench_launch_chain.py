"""benchmark/tuning/bench_launch_chain.py's chain on the CPU, through Triton's interpreter (the
timing needs a CUDA GPU): each launch reads what the one before it wrote."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import require_triton_interpreter

from script_import import import_script

require_triton_interpreter()


@pytest.mark.parametrize("launches", [1, 2, 7])
def test_each_launch_adds_one_to_the_last_ones_output(launches):
    bench = import_script("benchmark/tuning/bench_launch_chain.py")
    a = torch.zeros(3, dtype=torch.int32)
    b = torch.zeros_like(a)
    bench.launch_chain(a, b, launches, pdl=False)
    last = b if launches % 2 else a  # the odd launches write b
    assert last.tolist() == [launches] * 3
