"""The sampler's noise kernel on the CPU through Triton's interpreter: bit-equal to the torch
code, and the Sampler's Triton route picks the tokens its torch route picks."""

from __future__ import annotations

import torch
from triton_interpreter import require_triton_interpreter

require_triton_interpreter()

from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.kernels.seeded_uniform import seeded_uniform_vocab  # noqa: E402
from replaylm.layers.sampler import Sampler, SamplingBatchInfo, seeded_uniform  # noqa: E402
from replaylm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 1000  # not a multiple of the block: the last block is masked


def test_kernel_noise_is_bit_equal_to_the_torch_code():
    seeds = torch.tensor([0, 1, 12345, 2**63 - 1, 987654321987], dtype=torch.int64)
    steps = torch.tensor([0, 7, 1, 4095, 2**40], dtype=torch.int64)
    got = seeded_uniform_vocab(seeds, steps, VOCAB, block=256)
    want = seeded_uniform(seeds, steps, torch.arange(VOCAB))
    assert got.shape == (5, VOCAB) and got.dtype == torch.float32
    assert torch.equal(got, want)
    assert float(got.min()) > 0 and float(got.max()) < 1


def test_sampler_triton_route_picks_the_torch_routes_tokens(monkeypatch):
    # no top-k/top-p/min-p: a batch with a filter sorts each row and draws the torch route's
    # noise for the sorted ids
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.9),
    ]
    info = SamplingBatchInfo.from_params(params, [3, 4, 5, 6], VOCAB, "cpu")
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 0.3
    sampler = Sampler()
    picks = {}
    for route in ("torch", "triton"):
        if route == "triton":
            monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
        picks[route] = [sampler(logits, info, torch.full((4,), step)).tolist() for step in range(6)]
    assert picks["triton"] == picks["torch"]
    assert len({tuple(p[1:3]) for p in picks["torch"]}) > 1  # the noise moves with the step
