"""Capturing every default decode shape compiles few Triton variants: row counts, slice counts
and the one-element-per-request index pointers are not specialised (each variant is a JIT compile
that a host's first start pays inside capture). The sampler and the penalties compile one variant
for every batch size (a variant compiled while serving stalls the batch: 0.6 s on a cold Triton
cache).

Counted in a fresh process (Triton's in-memory kernel caches start empty there), on a dummy
Qwen3-0.6B with 256 decode shapes' worth of requests: shapes 1-16 run the skinny matmul, larger
ones cuBLAS and the SiluAndMul kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "benchmark" / "configs" / "qwen3-0.6b.json"

pytestmark = pytest.mark.gpu

# kernel -> variants: the skinny matmul one per projection (qkv, o, gate-up with SiluAndMul, down,
# the LM head's float32 logits), RMSNorm with and without the residual add, decode attention with
# its slices merged by the merge kernel (small batches) and as one slice (batches that fill the
# GPU: no merge), one of each other
COUNT_VARIANTS = f"""
import json
from model_parity import dummy_runner
from replaylm.layers.attention.triton import decode
from replaylm.layers.kernels import (penalties, qk_norm_rope, rmsnorm, seeded_sample, silu_mul,
                                    skinny_matmul)
from replaylm.layers.sampler import SamplingBatchInfo
from replaylm.sampling_params import SamplingParams

runner = dummy_runner({str(QWEN3)!r}, "cuda", "bfloat16", attention_backend="triton",
                      max_running_requests=256, max_total_tokens=8192,
                      cuda_graph_mode='{{"decode": "full", "prefill": "disabled"}}')
assert runner.graph_runners["decode"].shapes[-1] == 256
import torch
for bs in range(1, 10):  # the packed per-row parameters start at offsets that follow bs
    info = SamplingBatchInfo.from_params([SamplingParams(temperature=0.7)] * bs, list(range(bs)),
                                         1000, "cuda")
    seeded_sample.seeded_sample(torch.randn(bs, 1000, device="cuda"), info.temperatures,
                                info.seeds, torch.arange(bs, device="cuda"))
counts = torch.zeros(32, 1000, dtype=torch.int32, device="cuda")
seen = torch.zeros(32, 1000, dtype=torch.bool, device="cuda")
for bs in (1, 5, 16, 17):  # specialised integers: 1, multiples of 16, the rest
    rows, values = torch.arange(bs, device="cuda"), torch.ones(3, bs, device="cuda")
    penalties.apply_penalties_kernel(torch.randn(bs, 1000, device="cuda"), counts, seen, rows,
                                     values)
kernels = {{"skinny_matmul": skinny_matmul._skinny_matmul_kernel,
           "rms_norm": rmsnorm._rms_norm_kernel, "qk_norm_rope": qk_norm_rope._qk_norm_rope_kernel,
           "decode_attention": decode._decode_kernel, "merge": decode._merge_kernel,
           "silu_mul": silu_mul._silu_mul_kernel,
           "seeded_sample": seeded_sample._block_argmax_kernel,
           "penalties": penalties._penalties_kernel}}
print(json.dumps({{name: sum(len(cache[0]) for cache in k.device_caches.values())
                  for name, k in kernels.items()}}))
"""


def test_decode_capture_compiles_one_variant_per_kernel_role():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "python"), str(ROOT / "test"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    done = subprocess.run(
        [sys.executable, "-c", COUNT_VARIANTS], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts == {
        "skinny_matmul": 5,
        "rms_norm": 2,
        "qk_norm_rope": 1,
        "decode_attention": 2,
        "merge": 1,
        "silu_mul": 1,
        "seeded_sample": 1,
        "penalties": 1,
    }
