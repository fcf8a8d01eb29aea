"""Triton attention kernels on the GPU against the ceilings measured in the same run.

    python benchmark/bench_attention.py [--json out.json]

Ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate
(8192^3). Cases (Qwen3-0.6B attention: 16 query heads, 8 KV heads, head dim 128, bf16):
- decode at bs 1/8/64/256 x context 1k/4k/16k: bytes moved (K and V once, the slot table, q and
  out) over time, against the copy bandwidth; and over an fp8 cache (e4m3) at bs 64/256 x 1k/4k.
  Timed as replays of a CUDA graph of several calls (as in a decode graph; no launch overhead),
  each call on other random KV slots so repeated calls do not run from L2;
- decode over mixed lengths (uniform in 100-2048 tokens) at bs 64/128/256, one slice per request,
  the programs started in request order and longest request first (the model's launch from
  LONGEST_FIRST_PROGRAMS_PER_SM programs per multiprocessor);
- extend: one 4096-token causal prompt (also against torch SDPA's flash kernel on the same q/k/v,
  KV heads repeated for it) and 8 prompts of 512 tokens on 2048-token prefixes: FLOP rate
  against the matmul rate (causal FLOPs only);
- the KV store: the fused Triton store against two index_put calls, in a graph and eagerly.
Times are medians of triton.testing.do_bench (CUDA events, warm-up first). Other tile shapes and
split counts: benchmark/tuning/bench_attention_sweep.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from replaylm.layers.attention.triton.kv_store import store_kv

from common import (
    CALLS_PER_GRAPH,
    DIM,
    DTYPE,
    HEADS,
    KV_HEADS,
    ExtendCase,
    KVCache,
    copy_bandwidth_gbs,
    decode_attention_bytes,
    graph_ms,
    json_path_arg,
    median_ms,
    mixed_decode_bytes,
    mixed_lengths,
    time_decode_attention,
    write_json,
)

DECODE_BS = (1, 8, 64, 256)
DECODE_CTX = (1024, 4096, 16384)
FP8_DECODE_BS = (64, 256)  # `--kv-cache-dtype fp8_e4m3`'s decode: its bytes are half
FP8_DECODE_CTX = (1024, 4096)
MIXED_BS = (64, 128, 256)
GOAL_DECODE_PCT = 70.0  # decode bs 64, ctx 4096: % of the copy bandwidth
GOAL_PREFILL_RATIO = 1.5  # 4096 causal prefill: time over SDPA flash


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    return 2 * 8192**3 / (median_ms(lambda: a @ b) / 1e3) / 1e12


def sdpa_ms(case: ExtendCase) -> float:
    """torch SDPA (flash) on the case's q/k/v, KV heads repeated, in its own `[B, H, L, D]`
    layout (one request, no prefix); checks that both compute the same output."""
    q = case.q.transpose(0, 1)[None].contiguous()
    k = case.k.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None].contiguous()
    v = case.v.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None].contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)
    case.run()
    err = float((case.out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 1e-2, f"extend and SDPA disagree ({err:.1e}): not the same function"
    return ms


def bench_store(tokens: int) -> dict:
    cache = KVCache(65536)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, DIM, device="cuda", dtype=DTYPE)
    k, v = qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    locs = [cache.tables(1, tokens, 1)[0][0].long() for _ in range(CALLS_PER_GRAPH)]

    def fused(i: int) -> None:
        store_kv(cache.k, cache.v, locs[i], k, v)

    def index_put(i: int) -> None:
        cache.k[locs[i]] = k
        cache.v[locs[i]] = v

    return {
        "tokens": tokens,
        "fused_graph_us": 1e3 * graph_ms(fused),
        "index_put_graph_us": 1e3 * graph_ms(index_put),
        "fused_eager_us": 1e3 * median_ms(lambda: fused(0)),
        "index_put_eager_us": 1e3 * median_ms(lambda: index_put(0)),
    }


def decode_row(cache: KVCache, bs: int, ctx: int, bandwidth: float) -> dict:
    """Decode of `bs` requests over `ctx` tokens of `cache` (the model's launch), its rate
    against the copy bandwidth."""
    ms = time_decode_attention(cache, bs, ctx)
    gbs = decode_attention_bytes(bs, ctx, cache.k.element_size()) / (ms / 1e3) / 1e9
    fp8 = cache.k.dtype == torch.float8_e4m3fn
    return {
        "kernel": "decode, fp8 cache" if fp8 else "decode",
        "case": f"bs{bs} ctx{ctx}",
        "us": 1e3 * ms,
        "GB/s": gbs,
        "pct_copy_bw": 100 * gbs / bandwidth,
        "TFLOP/s": 4 * bs * HEADS * ctx * DIM / (ms / 1e3) / 1e12,
    }


def mixed_length_rows(cache: KVCache, bandwidth: float) -> list[dict]:
    """Decode over random lengths, one slice per request: request order, then longest first."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs in MIXED_BS:
        lengths = mixed_lengths(bs, gen)
        moved = mixed_decode_bytes(lengths)
        for longest in (False, True):
            ms = time_decode_attention(
                cache, bs, int(lengths.max()), splits=1, lengths=lengths, longest=longest
            )
            gbs = moved / (ms / 1e3) / 1e9
            rows.append(
                {
                    "kernel": "decode",
                    "case": f"bs{bs} mixed {'longest first' if longest else 'request order'}",
                    "us": 1e3 * ms,
                    "GB/s": gbs,
                    "pct_copy_bw": 100 * gbs / bandwidth,
                    "TFLOP/s": 4 * HEADS * int(lengths.sum()) * DIM / (ms / 1e3) / 1e12,
                }
            )
    return rows


def main() -> None:
    json_path = json_path_arg(__doc__)
    torch.manual_seed(0)

    bandwidth, tflops = copy_bandwidth_gbs(), matmul_tflops()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy {bandwidth:.0f} GB/s (read + write), bf16 matmul {tflops:.0f} TFLOP/s")

    cache = KVCache(max(DECODE_BS) * max(DECODE_CTX))
    rows = [decode_row(cache, bs, ctx, bandwidth) for bs in DECODE_BS for ctx in DECODE_CTX]
    fp8_cache = KVCache(max(FP8_DECODE_BS) * max(FP8_DECODE_CTX), torch.float8_e4m3fn)
    rows += [
        decode_row(fp8_cache, bs, ctx, bandwidth) for bs in FP8_DECODE_BS for ctx in FP8_DECODE_CTX
    ]
    del fp8_cache
    rows += mixed_length_rows(cache, bandwidth)
    prompt, chunks = ExtendCase(1, 4096, 0), ExtendCase(8, 512, 2048)
    sdpa = sdpa_ms(prompt)
    for name, case in (("1x4096", prompt), ("8x512 on 2048", chunks)):
        ms = median_ms(case.run)
        rate = case.flops() / (ms / 1e3) / 1e12
        rows.append(
            {
                "kernel": "extend",
                "case": name,
                "us": 1e3 * ms,
                "TFLOP/s": rate,
                "pct_matmul": 100 * rate / tflops,
                **(
                    {"sdpa_flash_us": 1e3 * sdpa, "ratio_vs_sdpa": ms / sdpa}
                    if case is prompt
                    else {}
                ),
            }
        )
    stores = [bench_store(t) for t in (64, 4096)]

    print(
        f"\n{'kernel':8} {'case':26} {'us':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} "
        f"{'%mm':>5} {'vs SDPA':>8}"
    )
    for r in rows:
        print(
            f"{r['kernel']:8} {r['case']:26} {r['us']:9.1f} {r.get('GB/s', 0):7.0f} "
            f"{r.get('pct_copy_bw', 0):6.1f} {r['TFLOP/s']:8.1f} {r.get('pct_matmul', 0):5.1f} "
            f"{r.get('ratio_vs_sdpa', 0):8.2f}"
        )
    for s in stores:
        print(
            f"kv store {s['tokens']:5d} tokens: fused {s['fused_graph_us']:.1f} us / index_put "
            f"{s['index_put_graph_us']:.1f} us in a graph; eager {s['fused_eager_us']:.1f} / "
            f"{s['index_put_eager_us']:.1f} us"
        )

    by_case = {(r["kernel"], r["case"]): r for r in rows}
    goal_decode = by_case[("decode", "bs64 ctx4096")]
    goal_prefill = by_case[("extend", "1x4096")]
    summary = [
        {
            "name": "ceilings",
            "device": device,
            "copy_GBps": round(bandwidth),
            "matmul_TFLOPs": round(tflops),
        },
        {
            "name": "decode bs64 ctx4096",
            "us": round(goal_decode["us"], 1),
            "pct_copy_bw": round(goal_decode["pct_copy_bw"], 1),
            "goal": f">={GOAL_DECODE_PCT}",
            "met": goal_decode["pct_copy_bw"] >= GOAL_DECODE_PCT,
        },
        {
            "name": "decode bs1 ctx16384",
            "us": round(by_case[("decode", "bs1 ctx16384")]["us"], 1),
            "pct_copy_bw": round(by_case[("decode", "bs1 ctx16384")]["pct_copy_bw"], 1),
        },
        {
            "name": "decode bs128 mixed lengths, longest first over request order",
            "speedup": round(
                by_case[("decode", "bs128 mixed request order")]["us"]
                / by_case[("decode", "bs128 mixed longest first")]["us"],
                3,
            ),
        },
        {
            "name": "prefill 1x4096 causal",
            "us": round(goal_prefill["us"], 1),
            "sdpa_flash_us": round(goal_prefill["sdpa_flash_us"], 1),
            "ratio_vs_sdpa": round(goal_prefill["ratio_vs_sdpa"], 2),
            "goal": f"<={GOAL_PREFILL_RATIO}",
            "met": goal_prefill["ratio_vs_sdpa"] <= GOAL_PREFILL_RATIO,
        },
        {
            "name": "extend 8x512 on 2048",
            "us": round(by_case[("extend", "8x512 on 2048")]["us"], 1),
            "pct_matmul": round(by_case[("extend", "8x512 on 2048")]["pct_matmul"], 1),
        },
        {
            "name": "kv store 64 tokens (graph)",
            "fused_us": round(stores[0]["fused_graph_us"], 1),
            "index_put_us": round(stores[0]["index_put_graph_us"], 1),
        },
    ]
    if json_path:
        write_json(
            json_path,
            {
                "copy_GBps": bandwidth,
                "matmul_TFLOPs": tflops,
                "rows": rows,
                "kv_store": stores,
                "summary": summary,
            },
        )


if __name__ == "__main__":
    main()
