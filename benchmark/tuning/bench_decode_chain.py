"""Kernel launch choices timed inside a decode step's chain of kernels, not alone.

    python benchmark/tuning/bench_decode_chain.py [--sweep attention matmul] [--repeats 3]
                                                  [--json out.json]

The GPU side of a Qwen3-0.6B decode step without the host: per layer RMSNorm, the skinny QKV
matmul, the q/k norm + rope kernel storing K/V, decode attention over `ctx` cached tokens, the o
matmul, RMSNorm with the residual add, then the gate-up, SiLU-mul and down kernels; 28 layers
over distinct random weights and KV caches (so L2 holds none of them), captured in one CUDA
graph with PDL on (as this model's default decode step runs), replayed and timed with CUDA
events (median per replay). The choices of a cell are interleaved and each is timed `--repeats`
times, so they compare on one host at one time.

`attention`: slices per request (the launch's grid) x minimum slice length, per (bs, ctx) cell;
`*` marks the default (`num_kv_splits`, `MIN_SPLIT_LEN`). `attention_config`: the attention
kernel's launch (key block, warps, pipeline stages) at the default slices. `matmul`: launch
configs of the projections (`MatmulConfig`) at ctx 512. `fusion` (ctx 512): the gate-up matmul
with SiluAndMul in its epilogue (the default) against a separate SiluAndMul launch, the
attention's slices merged by a kernel of their own (the default, as in captured graphs) against
the merge by the last program to arrive (as eager calls do), and the step without some of its
kernels or over one layer's weights (wrong numbers; upper bounds of what fusing those kernels
away or keeping weights in L2 could give). Why this exists: alone in a graph the attention
kernel favoured up to 64 slices; inside the step fewer won, by up to 12% of the step
(docs/tuning.md, "Decode attention slices").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common.py

import torch

from replaylm.layers import kernels
from replaylm.layers.attention.triton.common import KernelConfig
from replaylm.layers.attention.triton.decode import CONFIG as ATTENTION_CONFIG
from replaylm.layers.attention.triton.decode import (
    MIN_SPLIT_LEN,
    decode_attention,
    decode_workspace,
    num_kv_splits,
)
from replaylm.layers.kernels.ops import linear
from replaylm.layers.kernels.qk_norm_rope import qk_norm_rope
from replaylm.layers.kernels.rmsnorm import rms_norm
from replaylm.layers.kernels.silu_mul import silu_and_mul
from replaylm.layers.kernels.skinny_matmul import (
    MAX_ROWS,
    MatmulConfig,
    matmul_config,
    reserve_workspace,
    skinny_matmul,
)

from common import model_config, replay_us, write_json

CONFIG = model_config("qwen3-0.6b")
LAYERS, HIDDEN = CONFIG["num_hidden_layers"], CONFIG["hidden_size"]
HEADS, KV_HEADS, DIM = (
    CONFIG["num_attention_heads"],
    CONFIG["num_key_value_heads"],
    CONFIG["head_dim"],
)
INTER = CONFIG["intermediate_size"]
DTYPE = torch.bfloat16
ATTENTION_CELLS = (
    (1, 512),
    (8, 512),
    (1, 2048),
    (8, 2048),
    (1, 8192),
    (16, 512),
    (32, 512),
    (64, 512),
    (128, 512),
    (256, 512),
    (64, 2048),
)
ATTENTION_CONFIG_CELLS = ((1, 512), (8, 512), (1, 2048), (16, 512))
MATMUL_CELLS = ((1, 512), (8, 512), (16, 512))
FUSION_CELLS = ((1, 512), (8, 512), (16, 512), (32, 512))
# the projections' (N, K) and the matmul choices tried: name -> {projection: config}
PROJECTIONS = {
    "qkv": ((HEADS + 2 * KV_HEADS) * DIM, HIDDEN),
    "o": (HIDDEN, HEADS * DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}

NORMS = {"input": HIDDEN, "post_attention": HIDDEN, "q": DIM, "k": DIM}
EPS = CONFIG["rms_norm_eps"]


def _configs(names: tuple[str, ...], **changes: int) -> dict[str, MatmulConfig]:
    """The default launch of these projections with `changes` (MatmulConfig fields)."""
    return {name: replace(matmul_config(*PROJECTIONS[name]), **changes) for name in names}


def _one_block(names: tuple[str, ...], block_k: int, **changes: int) -> dict[str, MatmulConfig]:
    """These projections with K in blocks of `block_k`, one block per program (split-K into as
    many slices as blocks), and `changes`."""
    return {
        name: replace(
            matmul_config(*PROJECTIONS[name]),
            block_k=block_k,
            split_k=-(-PROJECTIONS[name][1] // block_k),
            **changes,
        )
        for name in names
    }


ALL = tuple(PROJECTIONS)
MATMUL_CHOICES: dict[str, dict[str, MatmulConfig]] = {
    "default": {},
    "o/down split 4": _configs(("o", "down"), split_k=4),  # the default before split 8
    "o/down 16 cols": _configs(("o", "down"), block_n=16),
    "qkv/gate_up split 2": _configs(("qkv", "gate_up"), split_k=2),
    "8 warps": _configs(ALL, num_warps=8),
    "4 stages": _configs(ALL, num_stages=4),  # the default before 6
    "K blocks of 256, 3 stages": _configs(ALL, block_k=256, num_stages=3),
    "K blocks of 64, 8 stages": _configs(ALL, block_k=64, num_stages=8),
    "qkv/gate_up K blocks of 256": _configs(("qkv", "gate_up"), block_k=256, num_stages=3),
    "o/down K blocks of 256, split 4": _configs(
        ("o", "down"), block_k=256, num_stages=3, split_k=4
    ),
    "down K blocks of 256": _configs(("down",), block_k=256, num_stages=3),
    "down one block of 256": _one_block(("down",), 256, num_stages=3),
    "o/down one block of 256, 1 stage": _one_block(("o", "down"), 256, num_stages=1),
    "o/down one block of 512": _one_block(("o", "down"), 512, num_stages=1),
    "all one block of 256": _one_block(ALL, 256, num_stages=3),
}


@dataclass(frozen=True)
class Choice:
    """One way to run the step: attention `splits` x `min_split_len` with launch `attention`
    (the kernel's default where None), its slices merged by a kernel of their own as captured
    graphs do (`separate_merge`) or by the last program to arrive, matmul configs by
    projection (defaults where absent), SiluAndMul in the gate-up epilogue or its own launch,
    kernels left out (`skip`: "post_norm", "input_norm", "rope", "attention"), and every layer
    reading the first layer's weights (`shared_weights`: they stay in L2)."""

    splits: int
    min_split_len: int = MIN_SPLIT_LEN
    attention: KernelConfig | None = None
    separate_merge: bool = True
    matmuls: dict[str, MatmulConfig] = field(default_factory=dict)
    separate_silu: bool = False
    skip: tuple[str, ...] = ()
    shared_weights: bool = False


def fusion_choices(splits: int) -> dict[str, Choice]:
    """The `fusion` sweep's choices at `splits` attention slices."""
    return {
        "default": Choice(splits),
        "SiluAndMul launched alone": Choice(splits, separate_silu=True),
        "attention merged by its last program": Choice(splits, separate_merge=False),
        "bound: no post-attention norm": Choice(splits, skip=("post_norm",)),
        "bound: no norms": Choice(splits, skip=("post_norm", "input_norm")),
        "bound: no rope kernel": Choice(splits, skip=("rope",)),
        "bound: no attention": Choice(splits, skip=("attention",)),
        "bound: one layer's weights (in L2)": Choice(splits, shared_weights=True),
    }


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


class DecodeChain:
    """The step's kernels for `bs` requests of `ctx` cached tokens each (the last one this step's,
    stored by the rope kernel)."""

    def __init__(self, bs: int, ctx: int) -> None:
        self.bs = bs
        self.weights = [
            {name: _randn(n, k) / k**0.5 for name, (n, k) in PROJECTIONS.items()}
            | {name: _randn(width) * 0.1 + 1 for name, width in NORMS.items()}
            for _ in range(LAYERS)
        ]
        slots = bs * ctx + 1  # slot 0 unused
        self.caches = [
            (_randn(slots, KV_HEADS, DIM), _randn(slots, KV_HEADS, DIM)) for _ in range(LAYERS)
        ]
        self.table = (1 + torch.randperm(slots - 1, device="cuda")).to(torch.int32).view(bs, ctx)
        self.slots = self.table[:, -1].to(torch.int64)
        self.positions = torch.full((bs,), ctx - 1, device="cuda")
        self.seq_lens = torch.full((bs,), ctx, device="cuda")
        self.rows = torch.arange(bs, device="cuda")
        self.cos = torch.randn(ctx, DIM, device="cuda")
        self.sin = torch.randn(ctx, DIM, device="cuda")
        self.x, self.residual = _randn(bs, HIDDEN), _randn(bs, HIDDEN)

    def step_fn(self, choice: Choice) -> Callable[[], torch.Tensor]:
        """One step with these choices (the attention's workspace made now, outside a capture)."""
        workspace = decode_workspace(_randn(self.bs, HEADS, DIM), KV_HEADS, choice.splits)
        out = _randn(self.bs, HEADS, DIM)
        q_width, kv_width = HEADS * DIM, KV_HEADS * DIM

        def mm(
            x: torch.Tensor, w: dict[str, torch.Tensor], name: str, gated_silu: bool = False
        ) -> torch.Tensor:
            if self.bs > MAX_ROWS:  # as the model: cuBLAS, then SiluAndMul's kernel
                return linear(x, w[name], gated_silu=gated_silu)
            return skinny_matmul(x, w[name], config=choice.matmuls.get(name), gated_silu=gated_silu)

        def norm(
            x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, name: str
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return (x, residual) if name in choice.skip else rms_norm(x, weight, EPS, residual)

        def mlp(h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            if choice.separate_silu:
                return silu_and_mul(mm(h, w, "gate_up"))
            return mm(h, w, "gate_up", gated_silu=True)

        def step() -> torch.Tensor:
            x, residual = self.x, self.residual
            for i, (k_cache, v_cache) in enumerate(self.caches):
                w = self.weights[0 if choice.shared_weights else i]
                h, residual = norm(x, w["input"], residual, "input_norm")
                qkv = mm(h, w, "qkv")
                q, k = qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]
                v = qkv[:, q_width + kv_width :]
                if "rope" not in choice.skip:
                    q, _ = qk_norm_rope(
                        q,
                        k,
                        self.positions,
                        self.cos,
                        self.sin,
                        DIM,
                        (w["q"], w["k"], EPS),
                        kv_store=(v, k_cache, v_cache, self.slots),
                    )
                if "attention" not in choice.skip:
                    decode_attention(
                        q.reshape(self.bs, HEADS, DIM),
                        k_cache,
                        v_cache,
                        self.table,
                        self.rows,
                        self.seq_lens,
                        out,
                        DIM**-0.5,
                        choice.splits,
                        min_split_len=choice.min_split_len,
                        config=choice.attention,
                        workspace=workspace,
                        separate_merge=choice.separate_merge,
                    )
                o = mm(out.view(self.bs, q_width), w, "o")
                h, residual = norm(o, w["post_attention"], residual, "post_norm")
                x = mm(mlp(h, w), w, "down")
            return x

        return step


def sweep_cell(
    chain: DecodeChain, choices: dict[str, Choice], repeats: int
) -> dict[str, list[float]]:
    """choice name -> its times, the choices interleaved `repeats` times."""
    steps = {name: chain.step_fn(choice) for name, choice in choices.items()}
    times: dict[str, list[float]] = {name: [] for name in choices}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(replay_us(step))
    return times


def attention_choices(bs: int, sms: int) -> dict[str, Choice]:
    default = num_kv_splits(bs, KV_HEADS, sms)
    choices = {}
    for splits in sorted({default, 64, 16, 8, 4, 2, 1}, reverse=True):
        for min_len in (MIN_SPLIT_LEN, 2 * MIN_SPLIT_LEN):
            mark = "*" if (splits, min_len) == (default, MIN_SPLIT_LEN) else ""
            choices[f"{splits} slices, min {min_len}{mark}"] = Choice(splits, min_len)
    return choices


def attention_config_choices(splits: int) -> dict[str, Choice]:
    """The attention kernel's launch choices at `splits` slices, each slice at least one key
    block (the default's minimum)."""
    cfg = ATTENTION_CONFIG
    configs = {
        "default": cfg,
        "2 stages": cfg._replace(num_stages=2),
        "1 stage": cfg._replace(num_stages=1),
        "2 warps": cfg._replace(num_warps=2),
        "8 warps": cfg._replace(num_warps=8),
        "blocks of 32": cfg._replace(block_n=32),
        "blocks of 128": cfg._replace(block_n=128),
    }
    return {name: Choice(splits, c.block_n, attention=c) for name, c in configs.items()}


SWEEP_CELLS = {
    "attention": ATTENTION_CELLS,
    "attention_config": ATTENTION_CONFIG_CELLS,
    "matmul": MATMUL_CELLS,
    "fusion": FUSION_CELLS,
}


def sweep_choices(sweep: str, bs: int, sms: int) -> dict[str, Choice]:
    """The choices of one of SWEEP_CELLS' sweeps for a batch of `bs` on `sms` SMs."""
    if sweep == "attention":
        return attention_choices(bs, sms)
    splits = num_kv_splits(bs, KV_HEADS, sms)
    if sweep == "attention_config":
        return attention_config_choices(splits)
    if sweep == "fusion":
        return fusion_choices(splits)
    return {name: Choice(splits, matmuls=cfg) for name, cfg in MATMUL_CHOICES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", nargs="+", choices=tuple(SWEEP_CELLS), default=list(SWEEP_CELLS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    reserve_workspace(torch.device("cuda"))
    kernels.set_pdl(kernels.pdl_supported(torch.device("cuda")))
    rows = []
    for sweep in args.sweep:
        for bs, ctx in SWEEP_CELLS[sweep]:
            chain = DecodeChain(bs, ctx)
            choices = sweep_choices(sweep, bs, sms)
            for name, times in sweep_cell(chain, choices, args.repeats).items():
                rows.append(
                    {
                        "sweep": sweep,
                        "bs": bs,
                        "ctx": ctx,
                        "choice": name,
                        "us": times,
                        "median_us": statistics.median(times),
                        "choice_fields": asdict(choices[name]),
                    }
                )
            del chain
            torch.cuda.empty_cache()
    print(f"\n{'sweep':10s} {'bs':>3s} {'ctx':>5s}  {'choice':28s} {'us per step':>12s}  runs")
    for row in rows:
        runs = " ".join(f"{t:.1f}" for t in row["us"])
        print(
            f"{row['sweep']:10s} {row['bs']:3d} {row['ctx']:5d}  {row['choice']:28s} "
            f"{row['median_us']:12.1f}  {runs}"
        )
    if args.json:
        write_json(
            args.json,
            {
                "pdl": kernels.pdl_launch().get("USE_PDL", False),
                "summary": summary(rows),
                "rows": rows,
            },
        )


def summary(rows: list[dict]) -> list[dict]:
    """Per sweep and cell: the default choice's time and the fastest choice's."""
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["sweep"], row["bs"], row["ctx"]), []).append(row)
    out = []
    for (sweep, bs, ctx), cell in cells.items():
        default = next(r for r in cell if r["choice"] == "default" or r["choice"].endswith("*"))
        best = min(cell, key=lambda r: r["median_us"])
        out.append(
            {
                "sweep": sweep,
                "bs": bs,
                "ctx": ctx,
                "default_us": default["median_us"],
                "best": best["choice"],
                "best_us": best["median_us"],
            }
        )
    return out


if __name__ == "__main__":
    main()
