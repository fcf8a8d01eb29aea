"""The sampler's one-pass kernel on the CPU through Triton's interpreter: it picks the tokens of
the Sampler's torch route, greedy and sampled rows, over a vocabulary whose last block is
partial."""

from __future__ import annotations

import torch
from triton_interpreter import require_triton_interpreter

require_triton_interpreter()

from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.kernels.seeded_sample import seeded_sample  # noqa: E402
from replaylm.layers.sampler import Sampler, SamplingBatchInfo, seeded_uniform  # noqa: E402
from replaylm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 1000  # not a multiple of the block: the last block is masked


def test_kernel_picks_the_gumbel_max_of_the_torch_code():
    seeds = torch.tensor([0, 1, 12345, 2**63 - 1, 987654321987], dtype=torch.int64)
    temperatures = torch.tensor([0.0, 0.7, 1.3, 0.9, 0.05])
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    scaled = logits / torch.where(temperatures == 0, 1.0, temperatures).unsqueeze(1)
    for step in (0, 7, 4095, 2**40):
        steps = torch.full((5,), step, dtype=torch.int64)
        got = seeded_sample(logits, temperatures, seeds, steps, block=256)
        noise = seeded_uniform(seeds, steps, torch.arange(VOCAB))
        want = (scaled - torch.log(-torch.log(noise))).argmax(-1)
        want[0] = logits[0].argmax()
        assert got.dtype == torch.int64
        assert got.tolist() == want.tolist()
        column_major = logits.t().contiguous().t()  # same values, column stride 5
        assert seeded_sample(column_major, temperatures, seeds, steps, block=256).equal(got)


def test_sampler_triton_route_picks_the_torch_routes_tokens(monkeypatch):
    # no top-k/top-p/min-p: a batch with a filter runs the torch code on every route
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
