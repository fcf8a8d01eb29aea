"""The offline Engine on the real built-in checkpoint (SmolLM2-135M-Instruct, Q4_1 GGUF)."""

from __future__ import annotations

import os

import pytest
import torch
from kv_accounting import assert_kv_released
from transformers import AutoModelForCausalLM

from replaylm.entrypoints.engine import Engine
from replaylm.model_loader.builtin_models import resolve_model_path

GREEDY = {"temperature": 0.0}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", max_total_tokens=4096, max_running_requests=16)


@pytest.fixture(scope="module")
def hf_model():
    path = resolve_model_path("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_capital_of_france(engine):
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, **GREEDY})
    assert "Paris" in out["text"]


def test_chat_answers_paris(engine):
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, **GREEDY})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"  # ended on EOS


def test_greedy_tokens_equal_transformers_on_the_same_gguf(engine, hf_model):
    prompts = PROMPTS[:2]
    outs = engine.generate(prompts, {"max_new_tokens": 32, "ignore_eos": True, **GREEDY})
    for prompt, out in zip(prompts, outs, strict=True):
        ids = engine.tokenizer(prompt)["input_ids"]
        assert out["output_ids"] == _hf_greedy(hf_model, ids, 32), prompt


def test_batched_outputs_equal_each_request_alone(engine):
    params = {"max_new_tokens": 12, "ignore_eos": True, **GREEDY}
    together = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together, strict=True):
        assert engine.generate(prompt, params)["output_ids"] == out["output_ids"]


def test_max_new_tokens_and_stop_token_ids(engine):
    base = engine.generate(PROMPTS[2], {"max_new_tokens": 10, "ignore_eos": True, **GREEDY})
    assert base["meta_info"]["completion_tokens"] == 10
    assert base["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    stop_id = base["output_ids"][3]
    first = base["output_ids"].index(stop_id)
    out = engine.generate(PROMPTS[2], {"max_new_tokens": 10, "stop_token_ids": [stop_id], **GREEDY})
    assert out["output_ids"] == base["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_stop_string_is_not_emitted(engine):
    base = engine.generate(PROMPTS[0], {"max_new_tokens": 8, **GREEDY})["text"]
    assert "." in base
    out = engine.generate(PROMPTS[0], {"max_new_tokens": 8, "stop": ".", **GREEDY})
    assert out["text"] == base[: base.index(".")]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = {"max_new_tokens": 16, "temperature": 0.9, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(PROMPTS[2], params)["output_ids"]
    batched = engine.generate([PROMPTS[0], PROMPTS[2]], [GREEDY, params])[1]["output_ids"]
    assert alone == batched
    other = engine.generate(PROMPTS[2], {**params, "seed": 99})["output_ids"]
    assert other != alone


def test_kv_is_released_after_generation(engine):
    engine.generate(PROMPTS, {"max_new_tokens": 4, **GREEDY})
    assert_kv_released(engine)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "empty"),
        ({"input_ids": [1] * 9000}, "prompt has 9000 tokens"),
        ({"prompt": "a", "input_ids": [1]}, "exactly one"),
        ({"input_ids": [10**9]}, "input_ids must be ints in"),
        ({"prompt": "a", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"prompt": "a", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ],
)
def test_bad_requests_are_rejected(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
