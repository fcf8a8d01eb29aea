"""Launch choices of the Triton attention kernels, each timed alone (docs/tuning.md).

    python benchmark/tuning/bench_attention_sweep.py [--json out.json]

Qwen3-0.6B's attention heads (16 query, 8 KV, head dim 128), bf16, as benchmark/bench_attention.py
times them (decode: a CUDA graph of several calls on random KV slots; medians of
triton.testing.do_bench). Decode: slice count x minimum slice length at short contexts (a chat's
step), then tile shape, warps, pipeline stages and slice count at long ones, and random against
contiguous slots; over mixed lengths (uniform in 100-2048 tokens) at bs 40-128, one slice in
request order or longest first, and two slices longest first. Extend: tile shapes of a
4096-token causal prompt. Decode choices alone in a
graph favour more slices than inside a decode step: settle those with
benchmark/tuning/bench_decode_chain.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch

from replaylm.layers.attention.triton.common import KernelConfig

from common import (
    KV_HEADS,
    ExtendCase,
    KVCache,
    decode_attention_bytes,
    json_path_arg,
    median_ms,
    mixed_decode_bytes,
    mixed_lengths,
    time_decode_attention,
    write_json,
)

SHORT_CONTEXTS = ((1, 512), (8, 512), (1, 2048))  # (bs, ctx)
LONG_CONTEXTS = ((64, 4096), (1, 16384), (256, 1024))
MIXED_BS = (40, 48, 64, 96, 128)
MIXED_LAUNCHES = ((1, False), (1, True), (2, True))  # slices, longest first
DECODE_LAUNCHES = ((64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 4, 2), (64, 8, 3))  # n, warps, stages
EXTEND_LAUNCHES = (  # block_m, block_n, warps, stages
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 64, 8, 2),
    (128, 32, 8, 3),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (64, 32, 4, 3),
)


def decode_row(cache: KVCache, bs: int, ctx: int, **launch: object) -> dict:
    """One decode case under `launch` (time_decode_attention's keywords), with its byte rate."""
    ms = time_decode_attention(cache, bs, ctx, **launch)
    fields = {  # mixed lengths: their total is in the row, not the tensor
        k: str(v) if isinstance(v, KernelConfig) else v for k, v in launch.items() if k != "lengths"
    }
    return {
        "kernel": "decode",
        "case": f"bs{bs} ctx{ctx}",
        **fields,
        "us": 1e3 * ms,
        "GB/s": decode_attention_bytes(bs, ctx) / (ms / 1e3) / 1e9,
    }


def sweep() -> list[dict]:
    cache = KVCache(max(bs * ctx for bs, ctx in LONG_CONTEXTS))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [
        decode_row(cache, bs, ctx, splits=splits, min_split_len=min_len)
        for bs, ctx in SHORT_CONTEXTS
        for splits in (1, 2, 4, 8, 16)
        for min_len in (32, 64, 128, 256)
    ]
    for bs, ctx in LONG_CONTEXTS:
        for block_n, warps, stages in DECODE_LAUNCHES:
            config = KernelConfig(block_n=block_n, num_warps=warps, num_stages=stages)
            for splits in (None, 1, 2, 4, 16, 64):
                if splits is not None and bs * KV_HEADS * splits > 16 * 8 * sms:
                    continue  # a grid this large only measures its own launch
                rows.append(decode_row(cache, bs, ctx, config=config, splits=splits))
    rows += [decode_row(cache, 64, 4096, contiguous=c) for c in (False, True)]
    gen = torch.Generator().manual_seed(0)
    for bs in MIXED_BS:
        lengths = mixed_lengths(bs, gen)
        for splits, longest in MIXED_LAUNCHES:
            row = decode_row(
                cache, bs, int(lengths.max()), splits=splits, lengths=lengths, longest=longest
            )
            row.update(case=f"bs{bs} mixed", tokens=int(lengths.sum()))
            row["GB/s"] = mixed_decode_bytes(lengths) / (row["us"] / 1e6) / 1e9
            rows.append(row)
    prompt = ExtendCase(1, 4096, 0)
    for block_m, block_n, warps, stages in EXTEND_LAUNCHES:
        config = KernelConfig(block_n=block_n, num_warps=warps, num_stages=stages, block_m=block_m)
        ms = median_ms(lambda config=config: prompt.run(config))
        rows.append(
            {
                "kernel": "extend",
                "case": "1x4096",
                "config": str(config),
                "us": 1e3 * ms,
                "TFLOP/s": prompt.flops() / (ms / 1e3) / 1e12,
            }
        )
    return rows


def main() -> None:
    json_path = json_path_arg(__doc__)
    torch.manual_seed(0)
    rows = sweep()
    for r in rows:
        print(
            "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
        )
    if json_path:
        write_json(json_path, {"rows": rows})


if __name__ == "__main__":
    main()
