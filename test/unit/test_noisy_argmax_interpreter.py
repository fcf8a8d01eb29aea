"""The sampler's draw kernel on the CPU through Triton's interpreter: the picks of the torch code
(`argmax(probs / -log(seeded_uniform(...)))`), and the Sampler's Triton route picks the tokens its
torch route picks."""

from __future__ import annotations

import torch
from triton_interpreter import require_triton_interpreter

require_triton_interpreter()

from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.kernels.noisy_argmax import noisy_argmax  # noqa: E402
from replaylm.layers.sampler import Sampler, SamplingBatchInfo, seeded_uniform  # noqa: E402
from replaylm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 1000  # not a multiple of the block: the last block is masked


def test_kernel_picks_the_torch_codes_ids():
    seeds = torch.tensor([0, 1, 12345, 2**63 - 1, 987654321987], dtype=torch.int64)
    # nearly flat probabilities: the noise decides, so a wrong hash picks other ids
    probs = torch.softmax(0.05 * torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)),
                          dim=-1)
    picks = set()
    for step in (0, 1, 7, 4095, 2**40):
        steps = torch.full((5,), step, dtype=torch.int64)
        want = (probs / -torch.log(seeded_uniform(seeds, steps, torch.arange(VOCAB)))).argmax(-1)
        got = noisy_argmax(probs, seeds, steps, block=256)
        assert got.dtype == torch.int64 and torch.equal(got, want), step
        picks.update(got.tolist())
    assert len(picks) > 15  # the picks move with seed and step


def test_sampler_triton_route_picks_the_torch_routes_tokens(monkeypatch):
    # no top-k/top-p/min-p: a batch with a filter sorts each row and draws over the sorted ids
    # with the torch code
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.3), SamplingParams(temperature=0.9)]
    info = SamplingBatchInfo.from_params(params, [3, 4, 5, 6], VOCAB, "cpu")
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 0.3
    sampler = Sampler()
    picks = {}
    for route in ("torch", "triton"):
        if route == "triton":
            monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
        picks[route] = [sampler(logits, info, torch.full((4,), step)).tolist()
                        for step in range(6)]
    assert picks["triton"] == picks["torch"]
    assert len({tuple(p[1:3]) for p in picks["torch"]}) > 1  # the noise moves with the step
