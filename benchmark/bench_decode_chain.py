"""Kernel launch choices timed inside a decode step's chain of kernels, not alone.

    python benchmark/bench_decode_chain.py [--sweep attention matmul] [--repeats 3]
                                           [--json out.json]

The GPU side of a Qwen3-0.6B decode step without the host: per layer RMSNorm, the skinny QKV
matmul, the q/k norm + rope kernel storing K/V, decode attention over `ctx` cached tokens, the o
matmul, RMSNorm with the residual add, then the gate-up, SiLU-mul and down kernels; 28 layers
over distinct random weights and KV caches (so L2 holds none of them), captured in one CUDA
graph with PDL on (as this model's default decode step runs), replayed and timed with CUDA
events (median per replay). The choices of a cell are interleaved and each is timed `--repeats`
times, so they compare on one host at one time.

`attention`: slices per request (the launch's grid) x minimum slice length, per (bs, ctx) cell;
`*` marks the default (`num_kv_splits`, `MIN_SPLIT_LEN`). `matmul`: launch configs of the
projections (`MatmulConfig`) at ctx 512. Why this exists: alone in a graph the attention kernel
favoured up to 64 slices; inside the step 8 won, by up to 12% of the step
(benchmark/NOTES_attention.md, "Slices inside the step").
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from bench_one_batch import cuda_time_ms

from replaylm.layers import kernels
from replaylm.layers.attention.triton.decode import (
    MIN_SPLIT_LEN,
    decode_attention,
    decode_workspace,
    num_kv_splits,
)
from replaylm.layers.kernels.qk_norm_rope import qk_norm_rope
from replaylm.layers.kernels.rmsnorm import rms_norm
from replaylm.layers.kernels.silu_mul import silu_and_mul
from replaylm.layers.kernels.skinny_matmul import MatmulConfig, reserve_workspace, skinny_matmul

CONFIG = json.loads((Path(__file__).resolve().parent / "configs" / "qwen3-0.6b.json").read_text())
LAYERS, HIDDEN = CONFIG["num_hidden_layers"], CONFIG["hidden_size"]
HEADS, KV_HEADS, DIM = (CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"],
                        CONFIG["head_dim"])
INTER = CONFIG["intermediate_size"]
DTYPE = torch.bfloat16
ATTENTION_CELLS = ((1, 512), (8, 512), (1, 2048), (8, 2048), (1, 8192), (16, 512), (32, 512),
                   (64, 512))
MATMUL_CELLS = ((1, 512), (8, 512))
# the projections' (N, K) and the matmul choices tried: name -> {projection: config}
PROJECTIONS = {"qkv": ((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), "o": (HIDDEN, HEADS * DIM),
               "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}

NORMS = {"input": HIDDEN, "post_attention": HIDDEN, "q": DIM, "k": DIM}
EPS = CONFIG["rms_norm_eps"]


def _config(block_n: int, split_k: int, block_k: int = 128) -> MatmulConfig:
    return MatmulConfig(block_n, block_k, split_k, num_warps=4, num_stages=4)


MATMUL_CHOICES: dict[str, dict[str, MatmulConfig]] = {
    "default": {},
    "o/down split 2": {"o": _config(32, 2), "down": _config(32, 2)},
    "o/down split 4": {"o": _config(32, 4), "down": _config(32, 4)},  # the default before 8
    "o/down 16 cols, split 4": {"o": _config(16, 4), "down": _config(16, 4)},
    "qkv/gate_up 16 cols": {"qkv": _config(16, 1), "gate_up": _config(16, 1)},
    "qkv/gate_up split 2": {"qkv": _config(32, 2), "gate_up": _config(32, 2)},
}


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


class DecodeChain:
    """The step's kernels for `bs` requests of `ctx` cached tokens each (the last one this step's,
    stored by the rope kernel)."""

    def __init__(self, bs: int, ctx: int) -> None:
        self.bs = bs
        self.weights = [{name: _randn(n, k) / k**0.5 for name, (n, k) in PROJECTIONS.items()}
                        | {name: _randn(width) * 0.1 + 1 for name, width in NORMS.items()}
                        for _ in range(LAYERS)]
        slots = bs * ctx + 1  # slot 0 unused
        self.caches = [(_randn(slots, KV_HEADS, DIM), _randn(slots, KV_HEADS, DIM))
                       for _ in range(LAYERS)]
        self.table = (1 + torch.randperm(slots - 1, device="cuda")).to(torch.int32).view(bs, ctx)
        self.slots = self.table[:, -1].to(torch.int64)
        self.positions = torch.full((bs,), ctx - 1, device="cuda")
        self.seq_lens = torch.full((bs,), ctx, device="cuda")
        self.rows = torch.arange(bs, device="cuda")
        self.cos = torch.randn(ctx, DIM, device="cuda")
        self.sin = torch.randn(ctx, DIM, device="cuda")
        self.x, self.residual = _randn(bs, HIDDEN), _randn(bs, HIDDEN)

    def step_fn(self, splits: int, min_split_len: int,
                matmuls: dict[str, MatmulConfig]) -> Callable[[], torch.Tensor]:
        """One step with these choices (the attention's workspace made now, outside a capture)."""
        workspace = decode_workspace(_randn(self.bs, HEADS, DIM), KV_HEADS, splits)
        out = _randn(self.bs, HEADS, DIM)
        q_width, kv_width = HEADS * DIM, KV_HEADS * DIM

        def mm(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
            return skinny_matmul(x, w[name], config=matmuls.get(name))

        def step() -> torch.Tensor:
            x, residual = self.x, self.residual
            for w, (k_cache, v_cache) in zip(self.weights, self.caches, strict=True):
                h, residual = rms_norm(x, w["input"], EPS, residual)
                qkv = mm(h, w, "qkv")
                q, k = qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]
                v = qkv[:, q_width + kv_width :]
                q, _ = qk_norm_rope(q, k, self.positions, self.cos, self.sin, DIM,
                                    (w["q"], w["k"], EPS),
                                    kv_store=(v, k_cache, v_cache, self.slots))
                decode_attention(q.view(self.bs, HEADS, DIM), k_cache, v_cache, self.table,
                                 self.rows, self.seq_lens, out, DIM**-0.5, splits,
                                 min_split_len=min_split_len, workspace=workspace)
                o = mm(out.view(self.bs, q_width), w, "o")
                h, residual = rms_norm(o, w["post_attention"], EPS, residual)
                x = mm(silu_and_mul(mm(h, w, "gate_up")), w, "down")
            return x

        return step


def graph_us(step: Callable[[], torch.Tensor]) -> float:
    """Median microseconds per replay of a CUDA graph of `step`."""
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return cuda_time_ms(graph.replay, 20, 100) * 1e3


def sweep_cell(chain: DecodeChain, choices: dict[str, tuple[int, int, dict]],
               repeats: int) -> dict[str, list[float]]:
    """choice name -> its times, the choices interleaved `repeats` times."""
    steps = {name: chain.step_fn(*choice) for name, choice in choices.items()}
    times: dict[str, list[float]] = {name: [] for name in choices}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(graph_us(step))
    return times


def attention_choices(bs: int, sms: int) -> dict[str, tuple[int, int, dict]]:
    default = num_kv_splits(bs, KV_HEADS, sms)
    choices = {}
    for splits in sorted({default, 64, 16, 8, 4, 2}, reverse=True):
        for min_len in (MIN_SPLIT_LEN, 2 * MIN_SPLIT_LEN):
            mark = "*" if (splits, min_len) == (default, MIN_SPLIT_LEN) else ""
            choices[f"{splits} slices, min {min_len}{mark}"] = (splits, min_len, {})
    return choices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", nargs="+", choices=("attention", "matmul"),
                        default=["attention", "matmul"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    reserve_workspace(torch.device("cuda"))
    kernels.set_pdl(kernels.pdl_supported(torch.device("cuda")))
    rows = []
    for sweep in args.sweep:
        for bs, ctx in ATTENTION_CELLS if sweep == "attention" else MATMUL_CELLS:
            chain = DecodeChain(bs, ctx)
            if sweep == "attention":
                choices = attention_choices(bs, sms)
            else:
                splits = num_kv_splits(bs, KV_HEADS, sms)
                choices = {name: (splits, MIN_SPLIT_LEN, cfg)
                           for name, cfg in MATMUL_CHOICES.items()}
            for name, times in sweep_cell(chain, choices, args.repeats).items():
                rows.append({"sweep": sweep, "bs": bs, "ctx": ctx, "choice": name,
                             "us": times, "median_us": statistics.median(times),
                             "configs": {k: asdict(v) for k, v in choices[name][2].items()}})
            del chain
            torch.cuda.empty_cache()
    print(f"\n{'sweep':10s} {'bs':>3s} {'ctx':>5s}  {'choice':28s} {'us per step':>12s}  runs")
    for row in rows:
        runs = " ".join(f"{t:.1f}" for t in row["us"])
        print(f"{row['sweep']:10s} {row['bs']:3d} {row['ctx']:5d}  {row['choice']:28s} "
              f"{row['median_us']:12.1f}  {runs}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "pdl": kernels.pdl_launch().get("USE_PDL", False),
                                         "summary": summary(rows), "rows": rows}, indent=1))


def summary(rows: list[dict]) -> list[dict]:
    """Per sweep and cell: the default choice's time and the fastest choice's."""
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["sweep"], row["bs"], row["ctx"]), []).append(row)
    out = []
    for (sweep, bs, ctx), cell in cells.items():
        default = next(r for r in cell if r["choice"] == "default" or r["choice"].endswith("*"))
        best = min(cell, key=lambda r: r["median_us"])
        out.append({"sweep": sweep, "bs": bs, "ctx": ctx, "default_us": default["median_us"],
                    "best": best["choice"], "best_us": best["median_us"]})
    return out


if __name__ == "__main__":
    main()
