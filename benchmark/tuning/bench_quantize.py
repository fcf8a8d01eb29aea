"""The FP8 activation quantization launches of a prefill chunk against the copy bandwidth: the
RMSNorm with its residual add and quantization (`rms_norm_quantize`), SiluAndMul with its
quantization (`silu_and_mul_quantize`, at each `--chunks` width: the columns a program holds at
once) and the quantization alone (`quantize_activation`).

    python benchmark/tuning/bench_quantize.py [--models llama-3.1-8b qwen3-0.6b]
                                              [--rows 2048 8192] [--chunks 1024 4096 16384]
                                              [--json out.json]

Per model, row count and launch: microseconds per launch (CUDA-graph replays of ten launches,
PDL as the model runs them), the bytes it moves (bf16 in, e4m3 and the residual out) and the
rate against a device-to-device copy's. Memory-bound launches a prefill runs on every layer:
what they take above their bytes' time is what a change here can win.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch

from replaylm.layers.kernels import set_pdl
from replaylm.layers.quantization import fp8_kernels

from common import copy_bandwidth_gbs, model_config, replay_us, write_json

CALLS_PER_REPLAY = 10


def launches(
    hidden: int, intermediate: int, rows: int, chunks: list[int]
) -> dict[str, tuple[Callable[[], object], int]]:
    """(the launch, bytes it moves) by name, on random bf16 inputs of a layer's widths."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    x, residual, weight = randn(rows, hidden), randn(rows, hidden), randn(hidden)
    gate_up = randn(rows, 2 * intermediate)
    norm_bytes = rows * hidden * (2 + 2 + 2 + 1)  # x and residual in; residual and e4m3 out
    silu_bytes = rows * intermediate * (4 + 1)  # gate and up in, e4m3 out
    out = {
        "rms_norm_quantize": (
            lambda: fp8_kernels.rms_norm_quantize(x, weight, 1e-5, residual),
            norm_bytes,
        ),
        "quantize_activation": (
            lambda: fp8_kernels.quantize_activation(x),
            rows * hidden * (2 + 1),
        ),
    }
    for chunk in chunks:
        out[f"silu_and_mul_quantize chunk {chunk}"] = (
            lambda chunk=chunk: fp8_kernels.silu_and_mul_quantize(gate_up, chunk=chunk),
            silu_bytes,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    set_pdl(torch.cuda.get_device_capability()[0] >= 9)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'model':14} {'rows':>6} {'launch':36} {'us':>8} {'GB/s':>6} {'of copy':>7}")
    rows_out = []
    for model in args.models:
        config = model_config(model)
        for rows in args.rows:
            cases = launches(config["hidden_size"], config["intermediate_size"], rows, args.chunks)
            for name, (launch, nbytes) in cases.items():

                def body(launch: Callable[[], object] = launch) -> None:
                    for _ in range(CALLS_PER_REPLAY):
                        launch()

                us = replay_us(body) / CALLS_PER_REPLAY
                gbs = nbytes / us / 1e3
                rows_out.append(
                    {
                        "model": model,
                        "rows": rows,
                        "launch": name,
                        "us": round(us, 2),
                        "gb_s": round(gbs),
                        "of_copy": round(gbs / copy_gbs, 3),
                    }
                )
                print(f"{model:14} {rows:6d} {name:36} {us:8.1f} {gbs:6.0f} {gbs / copy_gbs:7.2f}")
    if args.json:
        write_json(args.json, {"copy_gb_s": round(copy_gbs), "rows": rows_out})


if __name__ == "__main__":
    main()
