"""Tune the fused MoE kernels' block configs for one layer shape on this GPU, and write the table
that `replaylm.layers.moe.block_configs` looks up.

    python benchmark/tuning/tune_moe.py --experts 128 --hidden 2048 --intermediate 768 --top-k 8
        [--dtype bfloat16 | fp8_w8a8 [--block-shape 128 128]] [--tokens 1 2 4 ... 4096]
        [--max-configs N] [--fix block_m=128 ...] [--out-dir DIR]

`--intermediate` is the size per rank (a tensor-parallel shard's). Per token count M: random
hidden states routed by random logits (softmax, top-k, renormalized) through random experts; each
config of the search space (`search_space`, pruned for M) runs the whole fused path
(`triton_experts`: the sort, both grouped GEMMs, the weighted sum), is checked against
`torch_experts` and timed as CUDA-graph replays (triton.testing.do_bench_cudagraph). The fastest
correct config of each M goes into `E=..,N=..,K=..,device_name=..,dtype=...json` in the configs
folder, merged into the table already there (the new token counts replace their old entries).

`--dtype fp8_w8a8`: the experts' weights quantized to e4m3 (per channel, or per `--block-shape`
block), bfloat16 hidden states quantized by the kernels; the reference is `torch_experts` with
the same scales, run on the CPU (its FP8 emulation there, the numbers' reference).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench_cudagraph

from replaylm.layers.moe.block_configs import (
    CONFIG_DIR,
    FP8_W8A8,
    MoeBlockConfig,
    config_file_name,
    default_config,
    device_name,
    fits_block,
    load_table,
    write_table,
)
from replaylm.layers.moe.routing import select_experts
from replaylm.layers.moe.torch_experts import Fp8ExpertScales, torch_experts
from replaylm.layers.moe.triton_experts import triton_experts
from replaylm.layers.quantization.fp8 import FP8_DTYPE, Block, quantize_weight

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# FP8 weights' hidden states: the FP8 checkpoints' models run in bfloat16
FP8_HIDDEN = torch.bfloat16
# max |got - want| / max |want| a config may reach: products rounded to the dtype either way
# (FP8 weights: their hidden states' dtype's; both sides multiply the same e4m3 inputs)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
BLOCK_M = (16, 32, 64, 128)
BLOCK_N = (32, 64, 128, 256)
BLOCK_K = (64, 128, 256)
GROUP_M = (1, 16, 32)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4, 5)
SHARED_MEMORY = 227 * 1024  # bytes a Hopper program may take


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, required=True, help="E: experts of the layer")
    parser.add_argument("--hidden", type=int, required=True, help="K: the model's hidden size")
    parser.add_argument(
        "--intermediate", type=int, required=True, help="N: an expert's intermediate size per rank"
    )
    parser.add_argument("--top-k", type=int, required=True, help="experts per token")
    parser.add_argument("--dtype", choices=sorted([*DTYPES, FP8_W8A8]), default="bfloat16")
    parser.add_argument(
        "--block-shape",
        type=int,
        nargs=2,
        default=None,
        metavar=("BN", "BK"),
        help="with --dtype fp8_w8a8: FP8 block scales of BN x BK (default: per channel)",
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument(
        "--max-configs",
        type=int,
        default=None,
        help="time at most this many configs per token count, evenly spaced in the search space",
    )
    parser.add_argument(
        "--fix",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="time only configs with these MoeBlockConfig fields (e.g. block_m=128 block_k=64): "
        "a large token count's search in minutes",
    )
    parser.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    args = parser.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(MoeBlockConfig)}
    args.fix = dict(item.split("=", 1) for item in args.fix)
    if not set(args.fix) <= fields:
        unknown = sorted(set(args.fix) - fields)
        parser.error(f"--fix takes fields of {sorted(fields)}, not {unknown}")
    args.fix = {name: int(value) for name, value in args.fix.items()}
    if args.block_shape is not None and args.dtype != FP8_W8A8:
        parser.error(f"--block-shape needs --dtype {FP8_W8A8}")
    args.block_shape = None if args.block_shape is None else tuple(args.block_shape)
    return args


def hidden_dtype(args: argparse.Namespace) -> torch.dtype:
    """The hidden states' dtype: `--dtype`, or bfloat16 for FP8 weights."""
    return FP8_HIDDEN if args.dtype == FP8_W8A8 else DTYPES[args.dtype]


def weight_dtype(args: argparse.Namespace) -> torch.dtype:
    """The experts' weights' dtype (the table's, `config_file_name`'s `dtype`)."""
    return FP8_DTYPE if args.dtype == FP8_W8A8 else DTYPES[args.dtype]


def shared_memory_bytes(config: MoeBlockConfig, dtype_bytes: int) -> int:
    """What the GEMM's pipeline keeps in shared memory: `num_stages` A and B tiles."""
    tile = config.block_m * config.block_k + config.block_k * config.block_n
    return config.num_stages * tile * dtype_bytes


def search_space(
    tokens: int, top_k: int, num_experts: int, dtype_bytes: int = 2, block: Block | None = None
) -> list[MoeBlockConfig]:
    """The configs worth timing for `tokens` tokens: row blocks no taller than twice an expert's
    expected rows (the busiest experts of a random routing take that many; rounded up to a power
    of two, at least 16), 8 warps only for tiles of 64 x 64 and more, pipelines that fit in
    shared memory, K steps within FP8 blocks `block`."""
    rows_per_expert = math.ceil(tokens * top_k / num_experts)
    tallest = max(16, triton.next_power_of_2(2 * rows_per_expert))
    space = []
    for m, n, k, group, warps, stages in itertools.product(
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS, NUM_STAGES
    ):
        config = MoeBlockConfig(m, n, k, group, warps, stages)
        if m > tallest or (warps == 8 and m * n < 64 * 64) or not fits_block(config, block):
            continue
        if shared_memory_bytes(config, dtype_bytes) <= SHARED_MEMORY:
            space.append(config)
    return space


def fixed(configs: list[MoeBlockConfig], fields: dict[str, int]) -> list[MoeBlockConfig]:
    """Those of `configs` with the values `fields` gives (`--fix`)."""
    return [c for c in configs if all(getattr(c, f) == v for f, v in fields.items())]


def sampled(configs: list[MoeBlockConfig], limit: int | None) -> list[MoeBlockConfig]:
    """At most `limit` of `configs`, evenly spaced (all without a limit)."""
    if limit is None or len(configs) <= limit:
        return configs
    return [configs[i * len(configs) // limit] for i in range(limit)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|, in float32."""
    diff = (got.float() - want.float()).abs().max()
    return (diff / want.float().abs().max().clamp_min(1e-30)).item()


Case = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Fp8ExpertScales | None
]


def make_case(tokens: int, args: argparse.Namespace) -> Case:
    """(hidden, w13, w2, topk_weights, topk_ids, FP8 scales or None) on the GPU, random,
    weights scaled so that the products stay near unit size (FP8: then quantized)."""
    dtype = hidden_dtype(args)
    experts, hidden, intermediate = args.experts, args.hidden, args.intermediate
    x = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    w13 = torch.randn(experts, 2 * intermediate, hidden, dtype=dtype, device="cuda")
    w2 = torch.randn(experts, hidden, intermediate, dtype=dtype, device="cuda")
    w13, w2 = w13 / hidden**0.5, w2 / intermediate**0.5
    logits = torch.randn(tokens, experts, device="cuda")
    weights, ids = select_experts(logits, args.top_k, renormalize=True)
    if args.dtype != FP8_W8A8:
        return x, w13, w2, weights, ids, None
    (w13, w13_scale), (w2, w2_scale) = (quantize_weight(w, args.block_shape) for w in (w13, w2))
    return x, w13, w2, weights, ids, Fp8ExpertScales(w13_scale, w2_scale, args.block_shape)


def reference(case: Case) -> torch.Tensor:
    """`torch_experts` of `case`: on its GPU, or with FP8 scales on the CPU (the emulation that
    is the FP8 numbers' reference), moved back."""
    x, w13, w2, weights, ids, fp8 = case
    if fp8 is None:
        return torch_experts(x, w13, w2, weights, ids)
    scales = Fp8ExpertScales(fp8.w13.cpu(), fp8.w2.cpu(), fp8.block_size)
    want = torch_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(), scales)
    return want.to(x.device)


def time_config(case: Case, want: torch.Tensor, config: MoeBlockConfig) -> float | None:
    """Milliseconds of one fused call under `config` (graph replays), None where it does not
    compile for this GPU or misses `want` by more than its dtype's tolerance."""
    try:
        got = triton_experts(*case, config=config)
    except OutOfResources:
        return None
    error = relative_error(got, want)
    if error > TOLERANCE[want.dtype]:
        print(f"  {config}: wrong (relative error {error:.2e}), skipped")
        return None
    return do_bench_cudagraph(lambda: triton_experts(*case, config=config))


def tune_tokens(tokens: int, args: argparse.Namespace) -> tuple[MoeBlockConfig, float, float]:
    """(fastest config, its ms, the default config's ms) for `tokens` tokens."""
    case = make_case(tokens, args)
    want = reference(case)
    dtype_bytes = weight_dtype(args).itemsize  # FP8: both tiles e4m3
    space = search_space(tokens, args.top_k, args.experts, dtype_bytes, args.block_shape)
    space = sampled(fixed(space, args.fix), args.max_configs)
    timed = {config: time_config(case, want, config) for config in space}
    results = {config: ms for config, ms in timed.items() if ms is not None}
    if not results:
        raise RuntimeError(f"no config of {len(space)} ran correctly for {tokens} tokens")
    best = min(results, key=results.__getitem__)
    default = default_config(tokens, args.experts, args.block_shape)
    default_ms = time_config(case, want, default)
    return best, results[best], float("nan") if default_ms is None else default_ms


def main() -> None:
    args = parse_args()
    gpu = device_name(torch.device("cuda"))
    name = config_file_name(
        args.experts, args.intermediate, args.hidden, weight_dtype(args), gpu, args.block_shape
    )
    path = args.out_dir / name
    table = dict(load_table(path) or {})
    for tokens in args.tokens:
        best, ms, default_ms = tune_tokens(tokens, args)
        table[tokens] = best
        print(f"M={tokens}: {best} {ms * 1e3:.1f} us (default {default_ms * 1e3:.1f} us)")
        write_table(path, table)  # after each M: a long run stopped early keeps what it found
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
