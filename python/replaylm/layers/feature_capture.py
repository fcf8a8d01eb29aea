"""Hidden states a target model keeps, by KV slot, for an EAGLE draft head.

An EAGLE head drafts from the target's hidden states: EAGLE from the final-norm hidden state of
each token, EAGLE-3 from the residual stream entering three of the target's layers. The target
writes them during every forward into a `FeatureStore`, indexed like its KV cache (one row per
token slot), so a head can catch up on any token the target has run, prefix-cache hits
included. The write is part of the forward, so every CUDA-graph mode captures it; under
torch.compile it is an opaque op (`replaylm::capture_features`) that tc_piecewise splits at and
runs eagerly, as it does attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from replaylm.layers.attention.ops import current_batch

if TYPE_CHECKING:
    from replaylm.model_executor.forward_batch import ForwardBatch

CAPTURE_OP_NAME = "replaylm::capture_features"


class FeatureStore:
    """`sites` hidden states of `hidden` values per KV slot (`slots` rows, the padding slot
    included), in `dtype` on `device`."""

    def __init__(
        self, sites: int, slots: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.data = torch.zeros(sites, slots, hidden, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(sites: int, hidden: int, dtype: torch.dtype) -> int:
        return sites * hidden * dtype.itemsize

    @property
    def width(self) -> int:
        """Values per token when read: every site's, side by side."""
        return self.data.shape[0] * self.data.shape[2]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """`[N, width]`: the tokens at `slots` (int64 `[N]`), sites in order."""
        return self.data[:, slots].transpose(0, 1).reshape(slots.shape[0], -1)


def _write(store: torch.Tensor, site: int, x: torch.Tensor, slots: torch.Tensor) -> None:
    store[site].index_copy_(0, slots, x[: slots.shape[0]])


@torch.library.custom_op(CAPTURE_OP_NAME, mutates_args=("store",))
def capture_features(x: torch.Tensor, store: torch.Tensor, site: int) -> None:
    """`x`'s rows into `store[site]` at the KV slots of the open attention_context's batch."""
    _write(store, site, x, current_batch().out_cache_loc)


@capture_features.register_fake
def _capture_features_fake(x: torch.Tensor, store: torch.Tensor, site: int) -> None:
    return None


class FeatureTap(nn.Module):
    """Where a model writes one site of a `FeatureStore`: `tap(x, batch)` stores `x [T, H]`
    at the batch's KV slots (`batch` None under torch.compile, which takes it from
    attention_context)."""

    store: torch.Tensor

    def __init__(self, store: FeatureStore, site: int) -> None:
        super().__init__()
        self.register_buffer("store", store.data, persistent=False)
        self.site = site

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None) -> None:
        if torch.compiler.is_compiling():
            torch.ops.replaylm.capture_features(x, self.store, self.site)
        else:
            assert batch is not None  # only compiled code runs without one
            _write(self.store, self.site, x, batch.out_cache_loc)
