"""The penalties kernel on the CPU through Triton's interpreter: bit-equal to the torch code of
`layers/logit_adjust.py`, over rows read in any order from the request table."""

from __future__ import annotations

import torch
from triton_interpreter import require_triton_interpreter

require_triton_interpreter()

from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.kernels.penalties import apply_penalties_kernel  # noqa: E402
from replaylm.layers.logit_adjust import apply_penalties  # noqa: E402

VOCAB = 1000  # not a multiple of the block: the last block is masked


def _case() -> tuple[torch.Tensor, ...]:
    """Logits of 5 batch rows (zeros and negatives among them) over a 6-row request table of
    random counts and prompt masks; rows in shuffled order, penalties from neutral to strong."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen) * 4
    logits[:, :50] = 0.0
    counts = torch.randint(0, 4, (6, VOCAB), generator=gen, dtype=torch.int32)
    counts[counts < 3] = 0  # most tokens unseen
    prompt_mask = torch.rand(6, VOCAB, generator=gen) < 0.1
    rows = torch.tensor([4, 0, 5, 2, 1])
    penalties = torch.tensor(
        [
            [1.0, 1.3, 0.7, 2.0, 1.1],  # repetition
            [0.0, 0.5, -1.25, 2.0, 0.1],  # frequency
            [0.0, -0.3, 1.5, -2.0, 0.7],  # presence
        ]
    )
    return logits, counts, prompt_mask, rows, penalties


def test_kernel_is_bit_equal_to_the_torch_code():
    logits, counts, prompt_mask, rows, penalties = _case()
    got = apply_penalties_kernel(logits, counts, prompt_mask, rows, penalties, block=256)
    want = apply_penalties(logits, counts, prompt_mask, rows, penalties)
    assert got.shape == (5, VOCAB) and got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(got[0], logits[0])  # the neutral row keeps its logits
    assert not torch.equal(got[1:], logits[1:])


def test_apply_penalties_takes_the_kernel_route_on_the_kernel_device(monkeypatch):
    case = _case()
    want = apply_penalties(*case)
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    assert torch.equal(apply_penalties(*case), want)
