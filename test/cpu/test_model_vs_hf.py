"""Our Llama / Qwen2 / Qwen3 against HF transformers on tiny random checkpoints (float32, CPU).

Prefill of a ragged batch, then 8 paged-KV decode steps, then chunked prefill over a cached
prefix: every next-token logit row must equal transformers' full-sequence forward to 1e-4.
"""

from __future__ import annotations

import functools

import pytest
import torch

from model_parity import chunked_prefill_over_prefix, make_runner, prefill_then_decode
from tiny_checkpoints import TINY_CONFIGS, write_tiny_checkpoint

close = functools.partial(torch.testing.assert_close, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_checkpoint(request.param, folder)
    return hf_model, make_runner(str(folder), "cpu", "float32")


def test_prefill_then_decode_matches_hf(setup):
    prefill_then_decode(*setup, close)


def test_chunked_prefill_over_cached_prefix_matches_hf(setup):
    chunked_prefill_over_prefix(*setup, close)
