"""FP8 GEMMs of real models' projections against bf16 cuBLAS: per-channel `torch._scaled_mm`
and the block-scaled Triton GEMM, each with its activation quantization and alone.

    python benchmark/bench_fp8_gemm.py [--models qwen3-0.6b llama-3.1-8b]
        [--rows 1 8 64 256 1024 8192] [--json out.json]

Per model (benchmark/configs/), projection (qkv, o, gate_up, down) and row count, random bf16
weights quantized to e4m3 both ways (per output channel; 128x128 blocks) and a random bf16
input; each variant captured in a CUDA graph and timed by triton.testing.do_bench_cudagraph
(median), in microseconds per call and TFLOP/s (2 M N K per call):

    bf16            torch.matmul (cuBLAS)
    channel         fp8_linear with per-channel scales: the per-token quantization kernel, then
                    torch._scaled_mm with row-wise scales
    channel_gemm    torch._scaled_mm alone, on an input quantized beforehand
    block           fp8_linear with 128x128 block scales: the per-token-group quantization
                    kernel, then the block-scaled Triton GEMM
    block_gemm      the block-scaled Triton GEMM alone (`block_config`: its launch)

Each graph calls its variant on copies of the weights in turn, enough FP8 copies to fill the
GPU's L2 cache twice (at most MAX_COPIES), so that small weights come from memory as in a
model's step rather than from L2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench_cudagraph

from replaylm.layers.quantization.fp8 import quantize_activation, quantize_weight
from replaylm.layers.quantization.fp8_kernels import block_fp8_matmul, block_gemm_config
from replaylm.layers.quantization.fp8_linear import fp8_linear

from common import model_config, write_json

DTYPE = torch.bfloat16
BLOCK = (128, 128)
MAX_COPIES = 64
VARIANTS = ("bf16", "channel", "channel_gemm", "block", "block_gemm")


def projections(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a Llama-family layer's projections (q, k and v fused; gate and up)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter = cfg.get("head_dim") or h // heads, cfg["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv) * d, h),
        "o": (h, heads * d),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
    }


def tflops(m: int, n: int, k: int, us: float) -> float:
    """The rate of one `[m, k] x [k, n]` GEMM taking `us` microseconds."""
    return 2 * m * n * k / (us * 1e-6) / 1e12


def weight_copies(n: int, k: int, l2_bytes: int) -> int:
    """How many copies of an `[n, k]` FP8 weight fill twice `l2_bytes` (1 to MAX_COPIES)."""
    return max(1, min(MAX_COPIES, math.ceil(2 * l2_bytes / (n * k))))


def graph_us(launch: Callable[[int], object], copies: int) -> float:
    """Median microseconds per `launch(i)` of a CUDA graph calling it for each i < copies."""

    def body() -> None:
        for i in range(copies):
            launch(i)

    return do_bench_cudagraph(body, return_mode="median") * 1e3 / copies


def variants(n: int, k: int, m: int, copies: int) -> dict[str, Callable[[int], object]]:
    """VARIANTS' calls on copy i of an `[n, k]` weight and one `[m, k]` input."""
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5 for _ in range(copies)]
    channel = [quantize_weight(w, None) for w in weights]
    block = [quantize_weight(w, BLOCK) for w in weights]
    token_q, token_scale = quantize_activation(x)
    group_q, group_scale = quantize_activation(x, BLOCK[1])
    return {
        "bf16": lambda i: torch.matmul(x, weights[i].t()),
        "channel": lambda i: fp8_linear(x, *channel[i], None),
        "channel_gemm": lambda i: torch._scaled_mm(
            token_q,
            channel[i][0].t(),
            scale_a=token_scale,
            scale_b=channel[i][1].reshape(1, -1),
            out_dtype=DTYPE,
        ),
        "block": lambda i: fp8_linear(x, *block[i], BLOCK),
        "block_gemm": lambda i: block_fp8_matmul(group_q, group_scale, *block[i], BLOCK, DTYPE),
    }


def bench_shape(n: int, k: int, m: int, l2_bytes: int) -> dict[str, Any]:
    """One row of the table: each variant's microseconds and TFLOP/s."""
    copies = weight_copies(n, k, l2_bytes)
    calls = variants(n, k, m, copies)
    us = {name: graph_us(call, copies) for name, call in calls.items()}
    cfg = block_gemm_config(m, n)
    return {
        "copies": copies,
        "us": {name: round(t, 2) for name, t in us.items()},
        "tflops": {name: round(tflops(m, n, k, t), 1) for name, t in us.items()},
        "block_config": f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}",
    }


def print_row(row: dict[str, Any]) -> None:
    us = " ".join(f"{row['us'][v]:>12.2f}" for v in VARIANTS)
    rate = " ".join(f"{row['tflops'][v]:>7.1f}" for v in VARIANTS)
    print(
        f"{row['model']:14} {row['proj']:8} {row['n']:6d} {row['k']:6d} {row['rows']:5d} "
        f"{us} | {rate} | {row['block_config']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64, 256, 1024, 8192])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    names = " ".join(f"{v + ' us':>12}" for v in VARIANTS)
    print(f"{'model':14} {'proj':8} {'N':>6} {'K':>6} {'M':>5} {names} | TFLOP/s (same order)")
    rows = []
    for model in args.models:
        for proj, (n, k) in projections(model_config(model)).items():
            for m in args.rows:
                row = {"model": model, "proj": proj, "n": n, "k": k, "rows": m}
                row |= bench_shape(n, k, m, l2_bytes)
                torch.cuda.empty_cache()  # the shape's weights and graphs are gone
                print_row(row)
                rows.append(row)
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
