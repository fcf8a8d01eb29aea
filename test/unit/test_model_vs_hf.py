"""Our Llama / Qwen2 / Qwen3 against HF transformers on tiny random checkpoints (float32, CPU).

Prefill of a ragged batch, then 8 paged-KV decode steps, then chunked prefill over a cached
prefix: every next-token logit row must equal transformers' full-sequence forward to 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs
from tiny_checkpoints import TINY_CONFIGS, write_tiny_checkpoint

PROMPT_LENS = [7, 1, 19, 12]
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_checkpoint(request.param, folder)
    runner = ModelRunner(ServerArgs(
        model_path=str(folder), device="cpu", dtype="float32", max_total_tokens=1024,
        max_running_requests=8,
    ))
    return hf_model, runner


def _hf_next_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def _make_reqs(vocab: int, seed: int) -> list[Req]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Req(i, torch.randint(3, vocab, (n,), generator=gen).tolist(), SamplingParams(), 0, 64)
        for i, n in enumerate(PROMPT_LENS)
    ]


def _check(hf_model, runner, reqs, logits) -> None:
    assert logits.shape == (len(reqs), runner.config.vocab_size)
    for req, row in zip(reqs, logits, strict=True):
        torch.testing.assert_close(row, _hf_next_logits(hf_model, req.all_ids), **TOL)


def test_prefill_then_decode_matches_hf(setup):
    hf_model, runner = setup
    reqs = _make_reqs(runner.config.vocab_size, seed=1)
    logits = runner.forward(prepare_extend(reqs, runner))
    _check(hf_model, runner, reqs, logits)
    for _ in range(8):
        for req, token in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            req.output_ids.append(token)
        logits = runner.forward(prepare_decode(reqs, runner))
        _check(hf_model, runner, reqs, logits)
    for req in reqs:
        release(req, runner)
    assert runner.token_allocator.available_size() == runner.max_total_tokens
    assert runner.req_to_token_pool.available_size() == 8


def test_chunked_prefill_over_cached_prefix_matches_hf(setup):
    hf_model, runner = setup
    reqs = _make_reqs(runner.config.vocab_size, seed=2)
    runner.forward(prepare_extend(reqs, runner, chunk_sizes=[3, 1, 10, 12]))
    rest = [r for r in reqs if r.kv_len < len(r.input_ids)]
    assert [r.kv_len for r in rest] == [3, 10]  # a mixed batch: prefixes of different lengths
    logits = runner.forward(prepare_extend(rest, runner))
    _check(hf_model, runner, rest, logits)
    for req in reqs:
        release(req, runner)
