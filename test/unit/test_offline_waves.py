"""The offline loop on a tiny checkpoint whose KV cache holds fewer tokens than the batch needs."""

from __future__ import annotations

import pytest

from replaylm.entrypoints.engine import Engine

from tiny_checkpoints import write_tiny_checkpoint

PARAMS = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    folder = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_checkpoint("llama3", folder)
    return Engine(model_path=str(folder), device="cpu", max_total_tokens=100)


def test_requests_beyond_the_cache_run_in_waves(engine):
    prompts = [[5, 6, 7, 8, 9, 10 + i] for i in range(5)]  # 46 slots each: 2 per wave of 100
    together = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    assert all(o["meta_info"]["completion_tokens"] == 40 for o in together)
    for ids, out in zip(prompts, together, strict=True):
        assert engine.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"] == out[
            "output_ids"
        ]
    assert engine.runner.token_allocator.available_size() == 100


def test_a_request_larger_than_the_cache_is_rejected(engine):
    with pytest.raises(ValueError, match="raise --max-total-tokens"):
        engine.generate(input_ids=[5] * 10, sampling_params={**PARAMS, "max_new_tokens": 95})
    assert engine.runner.token_allocator.available_size() == 100
