"""Launch configs of the fused MoE kernels (`triton_experts`): tile sizes, swizzle group, warps
and stages for a layer's shape, the batch's token count, the dtype and the GPU.

Tuned tables live in `configs/`, one JSON file per (E, N = intermediate per rank, K = hidden,
GPU, dtype: FP8 weights' is vLLM's `fp8_w8a8`, with their block shape where block-scaled), keyed
by token count M; benchmark/tuning/tune_moe.py writes them. A lookup takes the entry of the
nearest M; without a table, `default_config`'s heuristic. The result also names its source, so
that the start-up log can say which one a model runs with.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from replaylm.layers.quantization.fp8 import FP8_DTYPE, Block

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

_JSON_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")
# the dtype FP8 weights' tables are named by (vLLM's): both GEMM operands e4m3
FP8_W8A8 = "fp8_w8a8"


@dataclass(frozen=True)
class MoeBlockConfig:
    """One launch of the grouped GEMM: a program computes `block_m` sorted rows (one expert's)
    times `block_n` weight rows, over K in steps of `block_k`; `group_m` row blocks share a
    swizzle group (weight tiles reused from L2)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict[str, int]:
        """The entry as vLLM-style tables spell it."""
        sizes = (self.block_m, self.block_n, self.block_k, self.group_m)
        entry = dict(zip(_JSON_KEYS, sizes, strict=True))
        return entry | {"num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def from_json(cls, entry: dict[str, int]) -> MoeBlockConfig:
        """The config of a table entry (`to_json`'s keys; warps and stages may be absent)."""
        m, n, k, group = (int(entry[key]) for key in _JSON_KEYS)
        warps, stages = int(entry.get("num_warps", 4)), int(entry.get("num_stages", 3))
        return cls(m, n, k, group, warps, stages)


@functools.lru_cache(maxsize=16)
def device_name(device: torch.device) -> str:
    """The GPU's name as table files spell it (spaces as underscores), else the device type
    (cached: every call of the kernels asks)."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_")


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype of the experts' weights as table names spell it: `fp8_w8a8` for e4m3 (their
    activations run in e4m3 too, whatever the model's dtype), else torch's name."""
    return FP8_W8A8 if dtype == FP8_DTYPE else str(dtype).removeprefix("torch.")


def config_file_name(
    num_experts: int,
    intermediate: int,
    hidden: int,
    dtype: torch.dtype,
    device: str,
    block: Block | None = None,
) -> str:
    """`E=..,N=..,K=..,device_name=..,dtype=..[,block_shape=[bn,bk]].json`: vLLM's naming,
    plus the hidden size K (it changes the best tiles too) and always the dtype (`dtype_name`
    of the weights'); FP8 block scales' `block` as vLLM spells it."""
    shape = f"E={num_experts},N={intermediate},K={hidden}"
    blocks = "" if block is None else f",block_shape=[{block[0]},{block[1]}]"
    return f"{shape},device_name={device},dtype={dtype_name(dtype)}{blocks}.json"


@functools.lru_cache(maxsize=64)
def load_table(path: Path) -> dict[int, MoeBlockConfig] | None:
    """The table at `path` (token count -> config), None when there is no such file."""
    if not path.is_file():
        return None
    entries = json.loads(path.read_text())
    return {int(m): MoeBlockConfig.from_json(entry) for m, entry in entries.items()}


def write_table(path: Path, table: dict[int, MoeBlockConfig]) -> None:
    """Write `table` to `path` in ascending token count, one config per key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = {str(m): table[m].to_json() for m in sorted(table)}
    path.write_text(json.dumps(entries, indent=4) + "\n")
    load_table.cache_clear()
    moe_block_config.cache_clear()


# --deterministic: every batch takes this token count's config (`set_batch_invariant`)
BATCH_INVARIANT_TOKENS = 64
_batch_invariant = False


def set_batch_invariant(enabled: bool) -> None:
    """With `enabled` (`--deterministic`), every batch takes one block config: a row's sums then
    run in the same order whatever its batch (rows are independent within a config, and each
    token's k rows are summed in slot order). Set before any capture."""
    global _batch_invariant
    _batch_invariant = enabled


def config_tokens(tokens: int) -> int:
    """The token count whose config a batch of `tokens` takes (`set_batch_invariant`)."""
    return BATCH_INVARIANT_TOKENS if _batch_invariant else tokens


def nearest_tokens(table: dict[int, MoeBlockConfig], tokens: int) -> int:
    """The table's key closest to `tokens` (the smaller one on a tie)."""
    return min(sorted(table), key=lambda m: abs(m - tokens))


def fits_block(config: MoeBlockConfig, block: Block | None) -> bool:
    """Whether `config` runs FP8 weights of block scales `block` (None: any config does): its
    BLOCK_K divides the blocks' columns, so that each K step lies within one block's scale."""
    return block is None or block[1] % config.block_k == 0


def default_config(tokens: int, num_experts: int, block: Block | None = None) -> MoeBlockConfig:
    """vLLM's untuned choice: while there are at most as many tokens as experts, each expert gets
    a few rows, so 16-row blocks over wide K steps; larger batches fill 64-row blocks. With FP8
    block scales `block`, BLOCK_K cut to a divisor of the blocks' columns (`fits_block`)."""
    if tokens <= num_experts:
        config = MoeBlockConfig(block_m=16, block_n=32, block_k=64, group_m=1)
    else:
        config = MoeBlockConfig(block_m=64, block_n=64, block_k=32, group_m=8)
    if fits_block(config, block):
        return config
    assert block is not None
    return replace(config, block_k=math.gcd(config.block_k, block[1]))


@functools.lru_cache(maxsize=1024)
def moe_block_config(
    num_experts: int,
    intermediate: int,
    hidden: int,
    tokens: int,
    dtype: torch.dtype,
    device: str,
    block: Block | None = None,
    config_dir: Path = CONFIG_DIR,
) -> tuple[MoeBlockConfig, str]:
    """(config, source) for `tokens` tokens through `num_experts` experts of `intermediate`
    (per rank) x `hidden` weights of `dtype` (FP8: e4m3, with block scales `block` or per
    channel) on GPU `device` (`device_name`): the nearest entry of its table, source
    "table <file name>", else `default_config`, source "default"."""
    name = config_file_name(num_experts, intermediate, hidden, dtype, device, block)
    table = load_table(config_dir / name)
    if not table:
        return default_config(tokens, num_experts, block), "default"
    return table[nearest_tokens(table, tokens)], f"table {name}"
