"""Small-batch matmuls of real models' projections: cuBLAS vs the skinny Triton kernel (with and
without PDL), each launch inside a CUDA graph, as a decode step runs them.

    python benchmark/tuning/bench_matmul.py [--models qwen3-0.6b llama-3.1-8b] [--rows 1 8 16]
                                            [--configs [--fp8]] [--json out.json]

Per model (benchmark/configs/) and projection (qkv, o, gate_up, down or a MoE's router, lm_head)
and row count:
a graph of one launch per layer over that many distinct random weights (so that L2 holds none of
them, as in a step), replayed and timed with CUDA events (median); microseconds per launch and
the weight bytes per second that makes. The choice of `--small-batch-matmul auto` is read off
this table (docs/tuning.md, "Split-K skinny matmul"). `--configs`: instead, the skinny kernel's
launch choices (`CONFIG_CHOICES`, with PDL) against cuBLAS per projection (the layers', not the
LM head's), at decode rows and past them (`--rows 32 64 128 256`: the row-tile choices, which
split K over several row tiles too); with `--fp8` over e4m3 weights, against bf16 cuBLAS.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from replaylm.layers import kernels
from replaylm.layers.kernels.skinny_matmul import (
    MatmulConfig,
    matmul_config,
    reserve_workspace,
    skinny_matmul,
)
from replaylm.layers.quantization.fp8 import quantize_activation

from common import model_config, replay_us, write_json

WARMUP, REPEAT = 5, 30
MAX_COPY_BYTES = 4 * 2**30  # weights of one graph, at most (lm_head: fewer copies)


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a Llama-family layer's projections and the LM head; a mixture of
    experts' router in place of the dense MLP (its experts are `tune_moe.py`'s)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter = cfg.get("head_dim") or h // heads, cfg["intermediate_size"]
    attention = {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d)}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    mlp = {"router": (experts, h)} if experts else {"gate_up": (2 * inter, h), "down": (h, inter)}
    return {**attention, **mlp, "lm_head": (cfg["vocab_size"], h)}


def graph_us(launch: Callable[[int], object], count: int) -> float:
    """Median microseconds per launch of a CUDA graph of `launch(i)` for i < count."""

    def body() -> None:
        for i in range(count):
            launch(i)

    return replay_us(body, WARMUP, REPEAT) / count


def operands(n: int, k: int, rows: int, layers: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A `[rows, k]` input and one distinct random `[n, k]` bf16 weight per layer (fewer where
    they would pass MAX_COPY_BYTES)."""
    copies = max(1, min(layers, MAX_COPY_BYTES // (2 * n * k)))
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    return torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), weights


@contextlib.contextmanager
def pdl_launches() -> Iterator[None]:
    """The kernels launch with PDL while active."""
    kernels.set_pdl(True)
    try:
        yield
    finally:
        kernels.set_pdl(False)


def bench_shape(n: int, k: int, rows: int, layers: int) -> dict[str, float]:
    x, weights = operands(n, k, rows, layers)
    copies = len(weights)
    out = {
        "copies": copies,
        "cublas_us": graph_us(lambda i: F.linear(x, weights[i]), copies),
        "triton_us": graph_us(lambda i: skinny_matmul(x, weights[i]), copies),
    }
    with pdl_launches():
        out["triton_pdl_us"] = graph_us(lambda i: skinny_matmul(x, weights[i]), copies)
    return out


# name -> the changes to `matmul_config(N, K)` (MatmulConfig fields) tried by `--configs`
CONFIG_CHOICES: dict[str, dict[str, int | bool]] = {
    "default": {},
    "split 1": {"split_k": 1},
    "split 2": {"split_k": 2},
    "split 4": {"split_k": 4},
    "split 8": {"split_k": 8},
    "16 cols": {"block_n": 16},
    "16 cols, split 2": {"block_n": 16, "split_k": 2},
    "64 cols, split 4": {"block_n": 64, "split_k": 4},
    "split 4, 8 warps": {"split_k": 4, "num_warps": 8},
    "split 4, K 256": {"split_k": 4, "block_k": 256, "num_stages": 3},
    "split 4, 4 stages": {"split_k": 4, "num_stages": 4},
    "split 2, K 256": {"split_k": 2, "block_k": 256, "num_stages": 3},
    "16 cols, K 256": {"block_n": 16, "block_k": 256, "split_k": 1, "num_stages": 4},
    "64 cols, split 8": {"block_n": 64, "split_k": 8},
    "swapped, 64 cols": {"swap": True, "block_n": 64},
    "swapped, 64 cols, split 4": {"swap": True, "block_n": 64, "split_k": 4},
    "swapped, 64 cols, K 256, split 4": {
        "swap": True,
        "block_n": 64,
        "block_k": 256,
        "split_k": 4,
        "num_stages": 3,
    },
    # past 16 rows (a decode batch of up to 256): row tiles of 64 or 128
    "64 rows": {"block_m": 64, "split_k": 1},
    "64 rows, split 2": {"block_m": 64, "split_k": 2},
    "64 rows, 64 cols, split 2": {"block_m": 64, "block_n": 64, "split_k": 2},
    "128 rows, 64 cols, split 2": {"block_m": 128, "block_n": 64, "split_k": 2, "num_stages": 3},
    "64 rows, 128 cols, split 2, 8 warps": {
        "block_m": 64,
        "block_n": 128,
        "split_k": 2,
        "num_warps": 8,
        "num_stages": 3,
    },
    "swapped, 64 rows, 64 cols, split 2": {
        "swap": True,
        "block_m": 64,
        "block_n": 64,
        "split_k": 2,
    },
    "swapped, 128 rows, 64 cols, split 2": {
        "swap": True,
        "block_m": 128,
        "block_n": 64,
        "split_k": 2,
    },
    "swapped, 128 rows, 128 cols, 8 warps": {
        "swap": True,
        "block_m": 128,
        "block_n": 128,
        "split_k": 1,
        "num_warps": 8,
        "num_stages": 4,
    },
}


def config_choice(n: int, k: int, name: str, fp8: bool = False) -> MatmulConfig:
    """The launch of CONFIG_CHOICES' `name` for an `[n, k]` weight (e4m3 with `fp8`)."""
    return replace(matmul_config(n, k, fp8), **CONFIG_CHOICES[name])


def fp8_weights(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`weights` as e4m3 with one per-channel scale for all (random weights: the values do not
    change the time), as `--quantization fp8` holds them."""
    top = torch.finfo(torch.float8_e4m3fn).max
    scale = weights[0].float().abs().amax(dim=1) / top
    return [
        (w.float() / scale[:, None]).clamp(-top, top).to(torch.float8_e4m3fn) for w in weights
    ], scale


def sweep_configs(n: int, k: int, rows: int, layers: int, fp8: bool = False) -> dict[str, float]:
    """cuBLAS and each CONFIG_CHOICES launch (PDL on) of `[rows, k] x [n, k]^T`: name -> us per
    launch, over distinct weights as `bench_shape`; launches the workspace cannot take are left
    out. `fp8`: the skinny launches over e4m3 weights and the input quantized once, as decode
    runs them less the quantization's launch (cuBLAS: bf16's, what they replace)."""
    x, weights = operands(n, k, rows, layers)
    out = {"cublas": graph_us(lambda i: F.linear(x, weights[i]), len(weights))}
    skinny_weights, scale = fp8_weights(weights) if fp8 else (weights, None)
    x_in, x_scale = quantize_activation(x) if fp8 else (x, None)
    with pdl_launches():
        for name in CONFIG_CHOICES:
            cfg = config_choice(n, k, name, fp8)
            try:
                out[name] = graph_us(
                    lambda i, c=cfg: skinny_matmul(
                        x_in,
                        skinny_weights[i],
                        config=c,
                        out_dtype=x.dtype,
                        weight_scale=scale,
                        x_scale=x_scale,
                    ),
                    len(skinny_weights),
                )
            except (ValueError, OutOfResources):  # over the split-K workspace or shared memory
                continue
    return out


def main_configs(
    models: list[str], rows: list[int], json_path: Path | None, fp8: bool = False
) -> None:
    """The `--configs` table (and JSON)."""
    results = []
    for model in models:
        cfg = model_config(model)
        for name, (n, k) in projections(cfg).items():
            if name == "lm_head":
                continue
            for m in rows:
                times = sweep_configs(n, k, m, cfg["num_hidden_layers"], fp8)
                torch.cuda.empty_cache()
                best = min(times, key=times.get)
                results.append(
                    {
                        "model": model,
                        "proj": name,
                        "n": n,
                        "k": k,
                        "rows": m,
                        "us": times,
                        "best": best,
                    }
                )
                print(
                    f"{model:14} {name:8} M={m:<3d} best {best:18s} {times[best]:8.2f} us | "
                    + " | ".join(f"{c} {t:.2f}" for c, t in times.items()),
                    flush=True,
                )
    if json_path:
        write_json(json_path, {"rows": results})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument(
        "--configs", action="store_true", help="sweep the skinny kernel's launch choices instead"
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="with --configs: e4m3 weights with per-channel scales (--quantization fp8's decode)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    reserve_workspace(torch.device("cuda"))
    if args.configs:
        main_configs(args.models, args.rows, args.json, args.fp8)
        return
    rows = []
    print(
        f"{'model':14} {'proj':8} {'N':>7} {'K':>6} {'M':>3} {'cuBLAS us':>10} "
        f"{'triton us':>10} {'+PDL us':>8} {'cuBLAS GB/s':>12} {'triton GB/s':>12}"
    )
    for model in args.models:
        cfg = model_config(model)
        for name, (n, k) in projections(cfg).items():
            for m in args.rows:
                r = {
                    "model": model,
                    "proj": name,
                    "n": n,
                    "k": k,
                    "rows": m,
                    **bench_shape(n, k, m, cfg["num_hidden_layers"]),
                }
                torch.cuda.empty_cache()  # the shape's weights and graphs are gone
                gbs = {key: 2 * n * k / (r[f"{key}_us"] * 1e3) for key in ("cublas", "triton")}
                rows.append(r)
                print(
                    f"{model:14} {name:8} {n:7d} {k:6d} {m:3d} {r['cublas_us']:10.2f} "
                    f"{r['triton_us']:10.2f} {r['triton_pdl_us']:8.2f} "
                    f"{gbs['cublas']:12.0f} {gbs['triton']:12.0f}"
                )
    summary = [
        {
            "model": r["model"],
            "proj": r["proj"],
            "rows": r["rows"],
            "cublas_us": round(r["cublas_us"], 2),
            "triton_us": round(r["triton_us"], 2),
            "triton_pdl_us": round(r["triton_pdl_us"], 2),
        }
        for r in rows
        if r["rows"] == 1
    ]
    if args.json:
        write_json(args.json, {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
