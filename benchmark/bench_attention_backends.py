"""Attention backends side by side on the GPU, per phase and shape, through the backend interface a
layer calls (`--attention-backend` and `--prefill-attention-backend` choose from this table).

    python benchmark/bench_attention_backends.py [--backends triton flashinfer] [--json out.json]

One attention layer of Qwen3-0.6B (16 query heads, 8 KV heads, head dim 128: FlashInfer decodes
off tensor cores) and of Llama-3.1-8B (32, 8, 128: on tensor cores), bf16, over a KV pool of
random slots (page size 1, as the server's):
- decode, bs 1/8/64/256 x context 1k/4k/16k (bs x context at most 1M tokens): the attention call
  replayed from a CUDA graph, as a `full` decode graph runs it, after the backend's replay hook
  (`us`); the hook's own time, host and device, before each replay (`hook_us`: FlashInfer's plan
  and page-table gather, nothing for triton);
- prefill: one 4096-token prompt, 64 prompts of 512 tokens, 8 chunks of 512 tokens on
  2,048-token prefixes: the eager call (breakable prefill graphs run attention eagerly) after
  `init_forward_metadata` (`hook_us`, once per step for all layers).
Kernel times are triton.testing.do_bench medians (L2 flushed before each); hook times are medians
of 50 calls, each followed by a device sync.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from replaylm.layers.attention.base import AttentionBackend, CudaGraphAttentionBackend
from replaylm.layers.attention.layer import Attention
from replaylm.layers.attention.registry import create_attention_backend
from replaylm.mem_cache.kv_cache import KVCache
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool
from replaylm.mem_cache.token_allocator import TokenSlotAllocator
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode

from common import capture_graph, median_ms, write_json

DTYPE = torch.bfloat16
KV_HEADS, DIM = 8, 128
MODELS = {"qwen3-0.6b": 16, "llama-3.1-8b": 32}  # query heads
DECODE_BS = (1, 8, 64, 256)
DECODE_CTX = (1024, 4096, 16384)
MAX_DECODE_TOKENS = 2**20
PREFILL = {"1x4096": (1, 4096, 0), "64x512": (64, 512, 0), "8x512 on 2048": (8, 512, 2048)}
POOL_SLOTS = MAX_DECODE_TOKENS + 8192
HOOK_CALLS = 50


@dataclass
class Setup:
    """One backend for one model's attention, over a pool and request table of its own."""

    backend: AttentionBackend
    layer: Attention
    pool: KVPool
    table: ReqToTokenPool

    @classmethod
    def make(cls, name: str, heads: int) -> Setup:
        backend = create_attention_backend(name)
        layer = Attention(heads, KV_HEADS, DIM, DIM**-0.5, 0)
        backend.init_model([layer], DTYPE)
        pool = KVPool(POOL_SLOTS, 1, KV_HEADS, DIM, DTYPE, "cuda")
        pool.k_buffers[0].normal_()
        pool.v_buffers[0].normal_()
        table = ReqToTokenPool(max(DECODE_BS), max(DECODE_CTX) + 1, "cuda")
        return cls(backend, layer, pool, table)

    def batch(self, mode: ForwardMode, n: int, new: int, prefix: int) -> ForwardBatch:
        """`n` requests of `new` tokens after `prefix` cached ones, on distinct random slots."""
        slots = 1 + torch.randperm(POOL_SLOTS, device="cuda")[: n * (prefix + new)]
        slots = slots.to(torch.int32).view(n, prefix + new)
        self.table.req_to_token[:n, :prefix] = slots[:, :prefix]
        return ForwardBatch.create(
            mode,
            [[0] * new] * n,
            [prefix] * n,
            list(range(n)),
            slots[:, prefix:].flatten().tolist(),
            KVCache(self.pool, TokenSlotAllocator(self.pool.size), self.table),
            self.backend,
        )

    def qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def randn(heads: int) -> torch.Tensor:
            return torch.randn(tokens, heads, DIM, device="cuda", dtype=DTYPE)

        return randn(self.layer.num_heads), randn(KV_HEADS), randn(KV_HEADS)


def hook_us(hook: Callable[[], object]) -> float:
    """Median microseconds of `hook()` and a device sync after it."""
    times = []
    for _ in range(HOOK_CALLS):
        start = time.perf_counter()
        hook()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def decode_row(setup: Setup, bs: int, ctx: int) -> dict:
    backend = setup.backend
    assert isinstance(backend, CudaGraphAttentionBackend)
    batch = setup.batch(ForwardMode.DECODE, bs, 1, ctx - 1)
    q, k, v = setup.qkv(bs)
    out = torch.empty_like(q)
    backend.init_forward_metadata_capture_cuda_graph(batch)
    backend.store_kv(k, v, setup.layer, batch)
    backend.forward(q, k, v, setup.layer, batch, out)  # lazy initialisation, kernel loads
    graph = capture_graph(lambda: backend.forward(q, k, v, setup.layer, batch, out))
    backend.init_forward_metadata_replay_cuda_graph(batch)
    ms = median_ms(graph.replay)
    kv_bytes = 2 * bs * ctx * KV_HEADS * DIM * DTYPE.itemsize
    return {
        "phase": "decode",
        "case": f"bs{bs} ctx{ctx}",
        "us": 1e3 * ms,
        "GB/s": kv_bytes / (ms / 1e3) / 1e9,
        "hook_us": hook_us(lambda: backend.init_forward_metadata_replay_cuda_graph(batch)),
    }


def prefill_row(setup: Setup, case: str) -> dict:
    n, new, prefix = PREFILL[case]
    backend = setup.backend
    batch = setup.batch(ForwardMode.EXTEND, n, new, prefix)
    q, k, v = setup.qkv(n * new)
    out = torch.empty_like(q)
    backend.init_forward_metadata(batch)
    backend.store_kv(k, v, setup.layer, batch)
    ms = median_ms(lambda: backend.forward(q, k, v, setup.layer, batch, out))
    # causal: each new token attends to its prefix and the new tokens up to itself
    pairs = n * (new * prefix + new * (new + 1) // 2)
    flops = 4 * pairs * setup.layer.num_heads * DIM
    return {
        "phase": "prefill",
        "case": case,
        "us": 1e3 * ms,
        "TFLOP/s": flops / (ms / 1e3) / 1e12,
        "hook_us": hook_us(lambda: backend.init_forward_metadata(batch)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for model, heads in MODELS.items():
        for name in args.backends:
            setup = Setup.make(name, heads)
            assert isinstance(setup.backend, CudaGraphAttentionBackend)
            setup.backend.init_cuda_graph_state(max(DECODE_BS), max(DECODE_BS))
            for bs in DECODE_BS:
                for ctx in DECODE_CTX:
                    if bs * ctx <= MAX_DECODE_TOKENS:
                        rows.append({"model": model, "backend": name, **decode_row(setup, bs, ctx)})
            for case in PREFILL:
                rows.append({"model": model, "backend": name, **prefill_row(setup, case)})
            del setup
            torch.cuda.empty_cache()
    print(f"{'model':13} {'phase':8} {'case':14} " + " ".join(f"{b:>22}" for b in args.backends))
    keys = dict.fromkeys((r["model"], r["phase"], r["case"]) for r in rows)
    by = {(r["model"], r["phase"], r["case"], r["backend"]): r for r in rows}
    for model, phase, case in keys:
        cells = []
        for b in args.backends:
            r = by[(model, phase, case, b)]
            cells.append(f"{r['us']:9.1f} us (+{r['hook_us']:6.1f})")
        print(f"{model:13} {phase:8} {case:14} " + " ".join(f"{c:>22}" for c in cells))
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
