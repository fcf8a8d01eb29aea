"""One mixture-of-experts layer's experts alone: the fused Triton kernels against cuBLAS per
expert and against the weight-read floor.

    python benchmark/bench_moe_kernel.py [--model qwen3-30b-a3b]
        [--tokens 1 2 4 8 64 256 1024 4096 8192] [--json out.json]

The layer's shape comes from the model's config in benchmark/configs/ (experts, hidden size,
an expert's columns, top k), bfloat16, random weights and random routing logits (softmax top k,
renormalised as the model does). Per token count: `fused_us`, the Triton route the layer takes
(`triton_experts`: `route` "pairs", the unsorted kernels of a few tokens, or "sorted") replayed
from a CUDA graph; `sorted_us`, the sorted route (the sort by expert, the two grouped GEMMs,
the weighted sum) at every count;
`cublas_us`, the torch code (`torch_experts`: per expert reached, its tokens gathered and two
cuBLAS matmuls; it syncs with the host to find them, so it runs eagerly, timed by CUDA events);
`grouped_mm_us`, torch's grouped GEMM (`torch._grouped_mm`, CUTLASS on Hopper; the route of
torchtitan and of transformers' MoE integration): the pairs sorted by expert and their tokens
gathered, one grouped GEMM a projection, SiLU-and-mul between, the weighted sum (no host sync:
replayed from a CUDA graph);
`floor_us`, the bytes the layer must read (the experts the routing reached, whole, and the
activations) over the device-to-device copy bandwidth measured in this run. The block config
each count takes is named (a tuned table of this GPU, or the default).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from replaylm.layers.moe.block_configs import device_name, moe_block_config
from replaylm.layers.moe.pair_experts import PAIR_TOKENS
from replaylm.layers.moe.routing import select_experts
from replaylm.layers.moe.torch_experts import torch_experts
from replaylm.layers.moe.triton_experts import triton_experts
from replaylm.models.config import ModelConfig
from replaylm.models.moe import MoeForCausalLM
from replaylm.models.registry import get_model_class

from common import config_path, copy_bandwidth_gbs, cuda_time_ms, replay_us, write_json

DTYPE = torch.bfloat16


def layer_shape(model: str) -> tuple[int, int, int, int, bool]:
    """(experts, hidden size, an expert's columns, top k, renormalise) of `model`'s MoE layers."""
    config = ModelConfig.from_json_file(str(config_path(model)))
    model_class = get_model_class(config.architecture)
    if not issubclass(model_class, MoeForCausalLM):
        raise ValueError(f"{model} is not a mixture of experts ({config.architecture})")
    spec = model_class.moe_spec(config)
    return spec.num_experts, config.hidden_size, spec.expert_size, spec.top_k, spec.renormalize


def floor_bytes(ids: torch.Tensor, hidden: int, inter: int, tokens: int, top_k: int) -> int:
    """What the layer must read and write: each reached expert's weights once, the tokens'
    activations in, their k intermediate rows and k outputs, the result out (bf16)."""
    reached = int(ids.unique().numel())
    weights = reached * 3 * hidden * inter
    activations = tokens * hidden * 2 + tokens * top_k * (inter + hidden)
    return 2 * (weights + activations)


def grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`torch_experts`'s result (every id an expert of this rank) through `torch._grouped_mm`:
    the (token, slot) pairs sorted by expert, each expert's rows one group of both GEMMs."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().long()
    order = flat.argsort(stable=True)
    # scatter_add, not bincount: bincount sizes its output from the ids' max, a host sync
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=flat.device)
    ends = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0).to(torch.int32)
    gate_up = torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=ends)
    gate, up = gate_up.chunk(2, dim=-1)
    down = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)
    pairs = torch.empty_like(down)
    pairs[order] = down
    weighted = pairs.view(tokens, top_k, -1).float() * topk_weights[..., None]
    return weighted.sum(1).to(x.dtype)


def bench_tokens(
    shape: tuple[int, int, int, int, bool], tokens: int, bandwidth_gbs: float
) -> dict[str, Any]:
    experts, hidden, inter, top_k, renormalize = shape
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def rand(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device="cuda") * scale).to(DTYPE)

    x = rand(tokens, hidden, scale=1.0)
    w13 = rand(experts, 2 * inter, hidden, scale=0.02)
    w2 = rand(experts, hidden, inter, scale=0.02)
    weights, ids = select_experts(rand(tokens, experts, scale=1.0).float(), top_k, renormalize)
    config, source = moe_block_config(
        experts, inter, hidden, tokens, DTYPE, device_name(torch.device("cuda"))
    )
    fused = replay_us(lambda: triton_experts(x, w13, w2, weights, ids))
    sorted_ = replay_us(lambda: triton_experts(x, w13, w2, weights, ids, config=config))
    cublas = cuda_time_ms(lambda: torch_experts(x, w13, w2, weights, ids)) * 1e3
    grouped = replay_us(lambda: grouped_mm_experts(x, w13, w2, weights, ids))
    floor = floor_bytes(ids, hidden, inter, tokens, top_k) / (bandwidth_gbs * 1e3)
    return {
        "tokens": tokens,
        "experts_reached": int(ids.unique().numel()),
        "route": "pairs" if tokens <= PAIR_TOKENS else "sorted",
        "fused_us": round(fused, 1),
        "sorted_us": round(sorted_, 1),
        "cublas_us": round(cublas, 1),
        "grouped_mm_us": round(grouped, 1),
        "floor_us": round(floor, 1),
        "fused_over_floor": round(fused / floor, 2),
        "cublas_over_fused": round(cublas / fused, 2),
        "block_configs": source,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-30b-a3b", help="a config of benchmark/configs")
    parser.add_argument(
        "--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 64, 256, 1024, 4096, 8192]
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    shape = layer_shape(args.model)
    bandwidth = copy_bandwidth_gbs()
    rows = [{"model": args.model, **bench_tokens(shape, t, bandwidth)} for t in args.tokens]
    for row in rows:
        print(row)
    if args.json:
        write_json(args.json, {"copy_bandwidth_gbs": round(bandwidth), "rows": rows})


if __name__ == "__main__":
    main()
