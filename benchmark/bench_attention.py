"""Triton attention kernels on the GPU against the ceilings measured in the same run.

    python benchmark/bench_attention.py [--json out.json] [--sweep]

Ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate
(8192^3). Cases (Qwen3-0.6B attention: 16 query heads, 8 KV heads, head dim 128, bf16):
- decode at bs 1/8/64/256 x context 1k/4k/16k: bytes moved (K and V once, the slot table, q and
  out) over time, against the copy bandwidth. Timed as replays of a CUDA graph of several calls
  (as in a decode graph; no launch overhead), each call on other random KV slots so repeated
  calls do not run from L2;
- extend: one 4096-token causal prompt (also against torch SDPA's flash kernel on the same q/k/v,
  KV heads repeated for it) and 8 prompts of 512 tokens on 2048-token prefixes: FLOP rate
  against the matmul rate (causal FLOPs only);
- the KV store: the fused Triton store against two index_put calls, in a graph and eagerly.
Times are medians of triton.testing.do_bench (CUDA events, warm-up first). `--sweep` also times
other tile shapes and split counts of the two goal cases (the tuning behind the defaults).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from replaylm.layers.attention.triton.common import KernelConfig
from replaylm.layers.attention.triton.decode import decode_attention, num_kv_splits
from replaylm.layers.attention.triton.extend import extend_attention
from replaylm.layers.attention.triton.kv_store import store_kv

HEADS, KV_HEADS, DIM = 16, 8, 128
DTYPE = torch.bfloat16
DECODE_BS = (1, 8, 64, 256)
DECODE_CTX = (1024, 4096, 16384)
CALLS_PER_GRAPH = 10
SHORT_CONTEXTS = ((1, 512), (8, 512), (1, 2048))
GOAL_DECODE_PCT = 70.0  # decode bs 64, ctx 4096: % of the copy bandwidth
GOAL_PREFILL_RATIO = 1.5  # 4096 causal prefill: time over SDPA flash


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_ms(fn, calls: int = CALLS_PER_GRAPH) -> float:
    """Milliseconds per call of `fn(i)`, i = 0..calls-1, replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return median_ms(graph.replay) / calls


def copy_bandwidth_gbs() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) / 1e3) / 1e9


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    return 2 * 8192**3 / (median_ms(lambda: a @ b) / 1e3) / 1e12


class KVCache:
    """One layer's K and V for the largest decode case, random; slot 0 is padding."""

    def __init__(self, slots: int) -> None:
        shape = (slots + 1, KV_HEADS, DIM)
        self.k = torch.randn(shape, device="cuda", dtype=DTYPE)
        self.v = torch.randn(shape, device="cuda", dtype=DTYPE)
        self.slots = slots

    def tables(self, bs: int, ctx: int, n: int, contiguous: bool = False) -> list[torch.Tensor]:
        """`n` request-to-token tables `[bs, ctx]` of distinct random slots each (or, with
        `contiguous`, each request on consecutive slots from a random start)."""

        def one() -> torch.Tensor:
            if not contiguous:
                return 1 + torch.randperm(self.slots, device="cuda")[: bs * ctx]
            start = int(torch.randint(0, self.slots - bs * ctx + 1, ()))
            return 1 + start + torch.arange(bs * ctx, device="cuda")

        return [one().to(torch.int32).view(bs, ctx) for _ in range(n)]


def bench_decode(
    cache: KVCache,
    bs: int,
    ctx: int,
    config: KernelConfig | None = None,
    splits: int | None = None,
    min_split_len: int = 256,
    contiguous: bool = False,
) -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = splits or num_kv_splits(bs, KV_HEADS, sms)
    tables = cache.tables(bs, ctx, CALLS_PER_GRAPH, contiguous)
    q = torch.randn(bs, HEADS, DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    rows = torch.arange(bs, device="cuda")
    seq_lens = torch.full((bs,), ctx, device="cuda")
    return graph_ms(
        lambda i: decode_attention(
            q,
            cache.k,
            cache.v,
            tables[i],
            rows,
            seq_lens,
            out,
            DIM**-0.5,
            splits,
            min_split_len=min_split_len,
            config=config,
            separate_merge=True,
        )
    )  # as graphs do


def decode_bytes(bs: int, ctx: int) -> int:
    kv = 2 * bs * ctx * KV_HEADS * DIM * DTYPE.itemsize
    return kv + 4 * bs * ctx + 2 * bs * HEADS * DIM * DTYPE.itemsize


class ExtendCase:
    """Requests of `new` tokens each on `prefix` cached tokens, over a fresh random cache."""

    def __init__(self, n: int, new: int, prefix: int) -> None:
        t = n * new
        self.q = torch.randn(t, HEADS, DIM, device="cuda", dtype=DTYPE)
        self.k = torch.randn(t, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
        self.v = torch.randn(t, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
        self.cache = KVCache(n * (prefix + new))
        self.table = self.cache.tables(n, prefix + new, 1)[0]
        self.rows = torch.arange(n, device="cuda")
        self.prefix = torch.full((n,), prefix, device="cuda")
        self.new_lens = torch.full((n,), new, device="cuda")
        self.start = torch.arange(n, device="cuda") * new
        self.out = torch.empty_like(self.q)
        self.n, self.new, self.prefix_len = n, new, prefix

    def run(self, config: KernelConfig | None = None) -> None:
        extend_attention(
            self.q,
            self.k,
            self.v,
            self.out,
            self.cache.k,
            self.cache.v,
            self.table,
            self.rows,
            self.prefix,
            self.new_lens,
            self.start,
            self.new,
            DIM**-0.5,
            config=config,
        )

    def flops(self) -> float:
        pairs = self.new * self.prefix_len + self.new * (self.new + 1) / 2
        return 4 * self.n * HEADS * DIM * pairs

    def sdpa_ms(self) -> float:
        """torch SDPA (flash) on the same q/k/v, KV heads repeated, in its own `[B, H, L, D]`
        layout (one request, no prefix); checks that both compute the same output."""
        q = self.q.transpose(0, 1)[None].contiguous()
        k = self.k.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None].contiguous()
        v = self.v.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None].contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)
        self.run()
        err = float((self.out.float() - ref.float()).norm() / ref.float().norm())
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


def sweep(cache: KVCache, prompt: ExtendCase) -> list[dict]:
    rows = []
    for bs, ctx in SHORT_CONTEXTS:  # a decode step of a short chat: split count and split length
        for splits in (1, 2, 4, 8):
            for min_len in (64, 128, 256):
                ms = bench_decode(cache, bs, ctx, None, splits, min_split_len=min_len)
                rows.append(
                    {
                        "kernel": "decode",
                        "case": f"bs{bs} ctx{ctx}",
                        "config": "default",
                        "splits": splits,
                        "min_split_len": min_len,
                        "us": 1e3 * ms,
                        "GB/s": decode_bytes(bs, ctx) / (ms / 1e3) / 1e9,
                    }
                )
    for bs, ctx in ((64, 4096), (1, 16384), (256, 1024)):
        for bn, warps, stages in ((64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 4, 2), (64, 8, 3)):
            for splits in (None, 1, 2, 4, 16, 64):
                if splits is not None and bs * KV_HEADS * splits > 8 * 132 * 16:
                    continue
                cfg = KernelConfig(block_n=bn, num_warps=warps, num_stages=stages)
                ms = bench_decode(cache, bs, ctx, cfg, splits, min_split_len=64)
                rows.append(
                    {
                        "kernel": "decode",
                        "case": f"bs{bs} ctx{ctx}",
                        "config": str(cfg),
                        "splits": splits or "auto",
                        "us": 1e3 * ms,
                        "GB/s": decode_bytes(bs, ctx) / (ms / 1e3) / 1e9,
                    }
                )
    for contiguous in (False, True):
        ms = bench_decode(cache, 64, 4096, contiguous=contiguous)
        rows.append(
            {
                "kernel": "decode",
                "case": "bs64 ctx4096",
                "config": "default",
                "slots": "contiguous" if contiguous else "random",
                "us": 1e3 * ms,
                "GB/s": decode_bytes(64, 4096) / (ms / 1e3) / 1e9,
            }
        )
    for bm, bn, warps, stages in (
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 64, 8, 2),
        (128, 32, 8, 3),
        (64, 64, 4, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 3),
    ):
        cfg = KernelConfig(block_n=bn, num_warps=warps, num_stages=stages, block_m=bm)
        ms = median_ms(lambda cfg=cfg: prompt.run(cfg))
        rows.append(
            {
                "kernel": "extend",
                "case": "1x4096",
                "config": str(cfg),
                "us": 1e3 * ms,
                "TFLOP/s": prompt.flops() / (ms / 1e3) / 1e12,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--sweep", action="store_true", help="also time other configs")
    args = parser.parse_args()
    torch.manual_seed(0)

    bandwidth, tflops = copy_bandwidth_gbs(), matmul_tflops()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy {bandwidth:.0f} GB/s (read + write), bf16 matmul {tflops:.0f} TFLOP/s")

    cache = KVCache(max(DECODE_BS) * max(DECODE_CTX))
    rows = []
    for bs in DECODE_BS:
        for ctx in DECODE_CTX:
            ms = bench_decode(cache, bs, ctx)
            gbs = decode_bytes(bs, ctx) / (ms / 1e3) / 1e9
            rows.append(
                {
                    "kernel": "decode",
                    "case": f"bs{bs} ctx{ctx}",
                    "us": 1e3 * ms,
                    "GB/s": gbs,
                    "pct_copy_bw": 100 * gbs / bandwidth,
                    "TFLOP/s": 4 * bs * HEADS * ctx * DIM / (ms / 1e3) / 1e12,
                }
            )
    prompt, chunks = ExtendCase(1, 4096, 0), ExtendCase(8, 512, 2048)
    sdpa = prompt.sdpa_ms()
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
    sweeps = sweep(cache, prompt) if args.sweep else []

    print(
        f"\n{'kernel':8} {'case':16} {'us':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} "
        f"{'%mm':>5} {'vs SDPA':>8}"
    )
    for r in rows:
        print(
            f"{r['kernel']:8} {r['case']:16} {r['us']:9.1f} {r.get('GB/s', 0):7.0f} "
            f"{r.get('pct_copy_bw', 0):6.1f} {r['TFLOP/s']:8.1f} {r.get('pct_matmul', 0):5.1f} "
            f"{r.get('ratio_vs_sdpa', 0):8.2f}"
        )
    for s in stores:
        print(
            f"kv store {s['tokens']:5d} tokens: fused {s['fused_graph_us']:.1f} us / index_put "
            f"{s['index_put_graph_us']:.1f} us in a graph; eager {s['fused_eager_us']:.1f} / "
            f"{s['index_put_eager_us']:.1f} us"
        )
    for r in sweeps:
        print(
            "sweep "
            + "  ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
            )
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
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "copy_GBps": bandwidth,
                    "matmul_TFLOPs": tflops,
                    "rows": rows,
                    "kv_store": stores,
                    "sweep": sweeps,
                    "summary": summary,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
