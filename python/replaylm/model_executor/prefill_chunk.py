"""The prefill chunk a model takes when `--chunked-prefill-size` is not given.

A dense model's matmuls run near peak from a few hundred rows, so its chunk stays small
(`DEFAULT_PREFILL_CHUNK`), which keeps other requests' decode steps frequent; on a GPU of
`LARGE_GPU_BYTES` or more (SGLang's rule for the H100 and H200) it is `LARGE_GPU_PREFILL_CHUNK`,
whose fewer steps cost less host time between them (docs/tuning.md, "Prefill chunks"). A mixture of
experts' grouped GEMMs see a step's tokens spread over its experts: a chunk of T tokens gives
each expert T * k / E rows on average, and below `ROWS_PER_EXPERT` of them its weight tiles are
reread for few rows (docs/tuning.md, "MoE prefill chunks"). Such a model's chunk is raised to
give each expert that many rows, up to `MOE_CHUNK_CAP` (a step's stall of the running requests).
The offline Engine streams to no one, so a long step stalls nothing that waits: there a mixture
of experts takes `OFFLINE_ROWS_PER_EXPERT` rows up to `OFFLINE_MOE_CHUNK_CAP` (vLLM's offline
default on a GPU of this class), where the grouped GEMMs run nearer peak still.
"""

from __future__ import annotations

import torch
from torch import nn

from replaylm.layers.moe.layer import FusedMoE
from replaylm.server_args import DEFAULT_PREFILL_CHUNK

ROWS_PER_EXPERT = 512
MOE_CHUNK_CAP = 8192
OFFLINE_ROWS_PER_EXPERT = 1024
OFFLINE_MOE_CHUNK_CAP = 16384
LARGE_GPU_BYTES = 35 * 2**30
LARGE_GPU_PREFILL_CHUNK = 8192


def dense_prefill_chunk(device: torch.device) -> tuple[int, str]:
    """(tokens per prefill chunk, why) of a dense model on `device`."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if total >= LARGE_GPU_BYTES:
            return LARGE_GPU_PREFILL_CHUNK, f"a GPU of {total / 2**30:.0f} GiB"
    return DEFAULT_PREFILL_CHUNK, "the default"


def default_prefill_chunk(model: nn.Module, offline: bool = False) -> tuple[int, str]:
    """(tokens per prefill chunk, why) for `model` without a `--chunked-prefill-size`;
    `offline`: for the offline Engine."""
    dense, why = dense_prefill_chunk(next(model.parameters()).device)
    experts = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    if experts is None:
        return dense, why
    rows, cap = (
        (OFFLINE_ROWS_PER_EXPERT, OFFLINE_MOE_CHUNK_CAP)
        if offline
        else (ROWS_PER_EXPERT, MOE_CHUNK_CAP)
    )
    wanted = rows * experts.num_experts // experts.top_k
    chunk = min(cap, max(dense, -(-wanted // 256) * 256))
    return chunk, (
        f"{experts.num_experts} experts, top {experts.top_k}: about "
        f"{chunk * experts.top_k // experts.num_experts} rows per expert a step"
        + (", offline" if offline else "")
    )


def prefill_chunk(asked: int | None, model: nn.Module, offline: bool = False) -> tuple[int, str]:
    """(tokens per prefill chunk, why): `--chunked-prefill-size` where given, else `model`'s
    default (`offline`: the offline Engine's)."""
    if asked is not None:
        return asked, "--chunked-prefill-size"
    return default_prefill_chunk(model, offline)
