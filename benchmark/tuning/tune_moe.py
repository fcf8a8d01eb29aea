"""Tune the fused MoE kernels' block configs for one layer shape on this GPU, and write the table
that `replaylm.layers.moe.block_configs` looks up.

    python benchmark/tuning/tune_moe.py --experts 128 --hidden 2048 --intermediate 768 --top-k 8
        [--dtype bfloat16] [--tokens 1 2 4 ... 4096] [--max-configs N] [--out-dir DIR]

`--intermediate` is the size per rank (a tensor-parallel shard's). Per token count M: random
hidden states routed by random logits (softmax, top-k, renormalized) through random experts; each
config of the search space (`search_space`, pruned for M) runs the whole fused path
(`triton_experts`: the sort, both grouped GEMMs, the weighted sum), is checked against
`torch_experts` and timed as CUDA-graph replays (triton.testing.do_bench_cudagraph). The fastest
correct config of each M goes into `E=..,N=..,K=..,device_name=..,dtype=...json` in the configs
folder, merged into the table already there (the new token counts replace their old entries).
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench_cudagraph

from replaylm.layers.moe.block_configs import (
    CONFIG_DIR,
    MoeBlockConfig,
    config_file_name,
    default_config,
    device_name,
    load_table,
    write_table,
)
from replaylm.layers.moe.routing import select_experts
from replaylm.layers.moe.torch_experts import torch_experts
from replaylm.layers.moe.triton_experts import triton_experts

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# max |got - want| / max |want| a config may reach: products rounded to the dtype either way
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
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument(
        "--max-configs",
        type=int,
        default=None,
        help="time at most this many configs per token count, evenly spaced in the search space",
    )
    parser.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    return parser.parse_args(argv)


def shared_memory_bytes(config: MoeBlockConfig, dtype_bytes: int) -> int:
    """What the GEMM's pipeline keeps in shared memory: `num_stages` A and B tiles."""
    tile = config.block_m * config.block_k + config.block_k * config.block_n
    return config.num_stages * tile * dtype_bytes


def search_space(
    tokens: int, top_k: int, num_experts: int, dtype_bytes: int = 2
) -> list[MoeBlockConfig]:
    """The configs worth timing for `tokens` tokens: row blocks no taller than an expert's
    expected rows (rounded up to a power of two, at least 16), 8 warps only for tiles of
    64 x 64 and more, pipelines that fit in shared memory."""
    rows_per_expert = math.ceil(tokens * top_k / num_experts)
    tallest = max(16, triton.next_power_of_2(rows_per_expert))
    space = []
    for m, n, k, group, warps, stages in itertools.product(
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS, NUM_STAGES
    ):
        config = MoeBlockConfig(m, n, k, group, warps, stages)
        if m > tallest or (warps == 8 and m * n < 64 * 64):
            continue
        if shared_memory_bytes(config, dtype_bytes) <= SHARED_MEMORY:
            space.append(config)
    return space


def sampled(configs: list[MoeBlockConfig], limit: int | None) -> list[MoeBlockConfig]:
    """At most `limit` of `configs`, evenly spaced (all without a limit)."""
    if limit is None or len(configs) <= limit:
        return configs
    return [configs[i * len(configs) // limit] for i in range(limit)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|, in float32."""
    diff = (got.float() - want.float()).abs().max()
    return (diff / want.float().abs().max().clamp_min(1e-30)).item()


def make_case(tokens: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """(hidden, w13, w2, topk_weights, topk_ids) on the GPU, random, weights scaled so that the
    products stay near unit size."""
    on = {"dtype": DTYPES[args.dtype], "device": "cuda"}
    experts, hidden, intermediate = args.experts, args.hidden, args.intermediate
    x = torch.randn(tokens, hidden, **on)
    w13 = torch.randn(experts, 2 * intermediate, hidden, **on) / hidden**0.5
    w2 = torch.randn(experts, hidden, intermediate, **on) / intermediate**0.5
    logits = torch.randn(tokens, experts, device="cuda")
    weights, ids = select_experts(logits, args.top_k, renormalize=True)
    return x, w13, w2, weights, ids


def time_config(
    case: tuple[torch.Tensor, ...], want: torch.Tensor, config: MoeBlockConfig
) -> float | None:
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
    want = torch_experts(*case)
    dtype_bytes = DTYPES[args.dtype].itemsize
    space = sampled(search_space(tokens, args.top_k, args.experts, dtype_bytes), args.max_configs)
    timed = {config: time_config(case, want, config) for config in space}
    results = {config: ms for config, ms in timed.items() if ms is not None}
    if not results:
        raise RuntimeError(f"no config of {len(space)} ran correctly for {tokens} tokens")
    best = min(results, key=results.__getitem__)
    default_ms = time_config(case, want, default_config(tokens, args.experts))
    return best, results[best], float("nan") if default_ms is None else default_ms


def main() -> None:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    name = config_file_name(
        args.experts, args.intermediate, args.hidden, dtype, device_name(torch.device("cuda"))
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
