"""Sampler: greedy rows, seeded determinism, the sampled distribution and the filters."""

from __future__ import annotations

import math

import pytest
import torch

from replaylm.layers.sampler import Sampler, SamplingBatchInfo, seeded_uniform
from replaylm.sampling_params import SamplingParams

# Chi-square critical values at p = 1e-5, by degrees of freedom (scipy.stats.chi2.isf(1e-5, df)).
_CHI2_CRIT = {1: 19.51, 2: 23.03, 3: 25.90, 7: 35.26, 19: 57.37}
_SAMPLER = Sampler()
_U64 = 2**64 - 1


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
) -> torch.Tensor:
    """Run the sampler on [B, V] logits with one params entry per row."""
    batch, vocab = logits.shape
    seeds = list(range(batch)) if seeds is None else seeds
    steps_t = torch.zeros(batch, dtype=torch.int64) if steps is None else torch.tensor(steps)
    info = SamplingBatchInfo.from_params(params, seeds, vocab, "cpu")
    return _SAMPLER(logits, info, steps_t)


def _draw(probs: list[float], n: int, *, vary: str = "seed", **kw: float) -> torch.Tensor:
    """n samples from one logits row log(probs), over n seeds (step 7) or n steps (seed 7)."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    params = [SamplingParams(**kw)] * n
    if vary == "seed":
        return _sample(logits, params, seeds=list(range(n)), steps=[7] * n)
    return _sample(logits, params, seeds=[7] * n, steps=list(range(n)))


def _assert_matches(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Frequencies of `tokens` match `expected`: zeros never drawn, chi-square and 4.5 sigma."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    expected = expected.double() / expected.sum()
    assert counts[expected == 0].sum() == 0, f"drew a token of probability 0: {counts}"
    support = expected > 0
    exp_counts = expected[support] * n
    chi2 = ((counts[support] - exp_counts) ** 2 / exp_counts).sum().item()
    df = int(support.sum()) - 1
    if df > 0:
        assert chi2 < _CHI2_CRIT[df], f"chi2={chi2:.1f} (df={df}); counts {counts} vs {exp_counts}"
    sigma = (expected * (1 - expected) / n).sqrt()
    freq = counts / n
    assert torch.all((freq - expected).abs() <= 4.5 * sigma + 1e-12), f"{freq} vs {expected}"


# ---------------------------------------------------------------------------------------------
# greedy


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 16
    info = SamplingBatchInfo.from_params(params, list(range(16)), 50, "cpu")
    assert info.all_greedy
    out = _SAMPLER(logits, info, torch.zeros(16, dtype=torch.int64))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_is_argmax_at_temperature_one() -> None:
    # Nearly flat logits: a real sample at temperature 1 would rarely hit the argmax.
    logits = 0.01 * torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    out = _sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 64)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    batch, vocab = 40, 100
    logits = 0.01 * torch.randn(batch, vocab, generator=torch.Generator().manual_seed(2))
    sampled_kinds = [
        SamplingParams(),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=50),
        SamplingParams(min_p=0.5),
    ]
    greedy_kinds = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)]
    params = [
        greedy_kinds[i // 2 % 2] if i % 2 else sampled_kinds[i // 2 % 4] for i in range(batch)
    ]
    info = SamplingBatchInfo.from_params(params, list(range(batch)), vocab, "cpu")
    assert not info.all_greedy and info.need_top_p_top_k and info.need_min_p
    out = _SAMPLER(logits, info, torch.zeros(batch, dtype=torch.int64))
    argmax = logits.argmax(dim=-1)
    greedy = torch.tensor([p.is_greedy for p in params])
    assert torch.equal(out[greedy], argmax[greedy])
    # The sampled rows really sample: over near-flat logits almost none lands on the argmax.
    assert (out[~greedy] != argmax[~greedy]).sum() >= 15


def test_flags_ignore_greedy_rows_and_top_k_at_vocab() -> None:
    params = [
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.5, top_k=3),
        SamplingParams(top_k=10),
        SamplingParams(top_k=1000),
    ]
    info = SamplingBatchInfo.from_params(params, [0, 1, 2], 10, "cpu")
    assert not info.all_greedy
    assert not info.need_top_p_top_k
    assert not info.need_min_p
    assert info.top_ks.tolist() == [3, 10, 10]
    assert info.temperatures.tolist() == [0.0, 1.0, 1.0]
    assert info.seeds.dtype == torch.int64 and info.top_ks.dtype == torch.int64
    assert info.temperatures.dtype == info.top_ps.dtype == info.min_ps.dtype == torch.float32


def test_from_params_rejects_seed_count_mismatch() -> None:
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatchInfo.from_params([SamplingParams()] * 2, [1], 10, "cpu")


# ---------------------------------------------------------------------------------------------
# determinism


def test_same_seed_and_step_give_same_token_regardless_of_batch() -> None:
    batch, vocab = 24, 64
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, vocab, generator=gen)
    seeds = [1000 + 17 * i for i in range(batch)]
    steps = [i % 5 for i in range(batch)]
    plain = [SamplingParams()] * batch
    together = _sample(logits, plain, seeds, steps)
    alone = torch.cat(
        [
            _sample(logits[i : i + 1], plain[:1], seeds[i : i + 1], steps[i : i + 1])
            for i in range(batch)
        ]
    )
    assert torch.equal(together, alone)
    # Reversed order, with companions that force the sorted (top-k/top-p/min-p) path.
    companions = [SamplingParams(top_k=5), SamplingParams(top_p=0.5, min_p=0.2)]
    noise_rows = torch.randn(len(companions), vocab, generator=gen)
    mixed_logits = torch.cat([logits.flip(0), noise_rows])
    mixed = _sample(mixed_logits, plain + companions, seeds[::-1] + [5, 6], steps[::-1] + [0, 0])
    assert torch.equal(mixed[:batch].flip(0), together)
    # And repeat calls are identical.
    assert torch.equal(_sample(logits, plain, seeds, steps), together)


def test_different_seeds_and_steps_give_different_tokens() -> None:
    vocab, n = 1000, 200
    flat = torch.zeros(n, vocab)
    plain = [SamplingParams()] * n
    by_seed = _sample(flat, plain, seeds=list(range(n)), steps=[0] * n)
    by_step = _sample(flat, plain, seeds=[42] * n, steps=list(range(n)))
    other_seed = _sample(flat, plain, seeds=[43] * n, steps=list(range(n)))
    # 200 uniform draws over 1000 tokens have ~181 distinct values in expectation.
    assert by_seed.unique().numel() > 160
    assert by_step.unique().numel() > 160
    assert (by_step == other_seed).sum() < 5


def test_sampler_accepts_extreme_seeds() -> None:
    logits = torch.zeros(2, 32)
    out = _sample(logits, [SamplingParams()] * 2, seeds=[0, 2**63 - 1])
    assert out.shape == (2,) and ((out >= 0) & (out < 32)).all()


# ---------------------------------------------------------------------------------------------
# distribution

_PROBS = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02]


@pytest.mark.parametrize("vary", ["seed", "step"])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_matches_softmax(temperature: float, vary: str) -> None:
    logits = torch.tensor([1.0, 0.5, 0.2, -0.3, 0.0, 0.8, -1.0, 0.1])
    tokens = _draw(logits.softmax(-1).tolist(), 20000, vary=vary, temperature=temperature)
    _assert_matches(tokens, torch.softmax(logits.double() / temperature, dim=-1))


def test_top_k_stays_in_top_k_with_renormalised_frequencies() -> None:
    tokens = _draw(_PROBS, 10000, top_k=3)
    _assert_matches(tokens, torch.tensor(_PROBS[:3] + [0.0] * 5))


def test_top_p_stays_in_nucleus_with_renormalised_frequencies() -> None:
    # Mass above each token: 0, .3, .5, .65 -> top_p=0.6 keeps the first three (.65 >= .6).
    tokens = _draw(_PROBS, 10000, top_p=0.6)
    _assert_matches(tokens, torch.tensor(_PROBS[:3] + [0.0] * 5))


def test_top_p_always_keeps_the_top_token() -> None:
    tokens = _draw(_PROBS, 500, top_p=0.01)
    assert (tokens == 0).all()


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    # After top_k=3: [.3, .2, .15] / .65 -> mass above: 0, .46, .77. top_p=0.7 keeps two tokens
    # (on the raw distribution it would keep all three: mass above the third is only .5).
    tokens = _draw(_PROBS, 10000, top_k=3, top_p=0.7)
    _assert_matches(tokens, torch.tensor(_PROBS[:2] + [0.0] * 6))


def test_min_p_drops_tokens_below_threshold() -> None:
    # Threshold 0.35 * 0.3 = 0.105 keeps the first four (0.12 survives, 0.1 does not).
    tokens = _draw(_PROBS, 10000, min_p=0.35)
    _assert_matches(tokens, torch.tensor(_PROBS[:4] + [0.0] * 4))


def test_filters_compose_in_one_batch() -> None:
    n = 3000
    kinds = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.35)]
    allowed = [2, 3, 4]
    logits = torch.tensor(_PROBS).log().expand(n * len(kinds), -1).contiguous()
    params = [k for k in kinds for _ in range(n)]
    out = _sample(logits, params, seeds=list(range(n * len(kinds)))).view(len(kinds), n)
    for row, limit in zip(out, allowed, strict=True):
        assert row.max() < limit
        assert row.unique().numel() == limit


# ---------------------------------------------------------------------------------------------
# the hash uniform


def _reference_uniform(seed: int, step: int, vocab_id: int) -> float:
    """seeded_uniform in plain unsigned Python ints: pins the hash and its int64 emulation."""
    golden = 0x9E3779B97F4A7C15

    def mix(x: int) -> int:
        x &= _U64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
        return x ^ (x >> 31)

    row = mix(mix(seed) + step * golden)
    bits = mix(row + (vocab_id + 1) * golden) >> 41
    return (bits + 0.5) / 2**23


def test_hash_uniform_matches_unsigned_reference() -> None:
    cases = [(0, 0, 0), (1, 2, 3), (2**63 - 1, 10**6, 151935), (123456789, 4095, 7)]
    seeds, steps, vocab = (torch.tensor(c, dtype=torch.int64) for c in zip(*cases, strict=True))
    got = seeded_uniform(seeds, steps, vocab.unsqueeze(1)).squeeze(1)
    want = torch.tensor([_reference_uniform(*c) for c in cases], dtype=torch.float32)
    assert torch.equal(got, want)


def test_hash_uniform_is_open_interval_and_uniform() -> None:
    u = seeded_uniform(torch.arange(500), torch.zeros(500, dtype=torch.int64), torch.arange(1000))
    assert u.shape == (500, 1000) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    n = u.numel()
    assert abs(u.double().mean().item() - 0.5) < 4.5 * math.sqrt(1 / 12 / n)
    assert abs(u.double().var().item() - 1 / 12) < 1e-3
    counts = torch.bincount((u * 20).long().flatten(), minlength=20).double()
    chi2 = ((counts - n / 20) ** 2 / (n / 20)).sum().item()
    assert chi2 < _CHI2_CRIT[19]
    # The extremes of the grid stay strictly inside (0, 1) in float32.
    assert 0 < (0 + 0.5) * 2.0**-23 and torch.tensor((2**23 - 0.5) * 2.0**-23) < 1


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def test_hash_uniform_is_decorrelated_across_steps_seeds_and_vocab() -> None:
    seeds, vocab = torch.arange(400), torch.arange(1000)
    zeros = torch.zeros(400, dtype=torch.int64)
    u0 = seeded_uniform(seeds, zeros, vocab)
    u1 = seeded_uniform(seeds, zeros + 1, vocab)
    tol = 4.5 / math.sqrt(u0.numel())
    assert abs(_corr(u0, u1)) < tol  # next step
    assert abs(_corr(u0[:-1], u0[1:])) < tol  # next seed
    assert abs(_corr(u0[:, :-1], u0[:, 1:])) < tol  # next vocab id
    assert not torch.equal(u0, u1)
    # Consecutive steps of one request do not land in the same place.
    assert (u0 == u1).float().mean() < 1e-3
