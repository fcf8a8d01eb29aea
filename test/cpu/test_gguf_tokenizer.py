"""The built-in SmolLM2 GGUF's tokenizer through the tokenizer cache: the first load builds it
with transformers and keeps it, later loads read the kept copy (with the tokenizers library
alone), which tokenizes, decodes, fills the chat template and describes itself to the scheduler
exactly as the built one does."""

from __future__ import annotations

import logging

import pytest

from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.fast_tokenizer import FastTokenizer
from replaylm.model_loader.gguf_tokenizer import CACHE_ENV, load_gguf_tokenizer
from replaylm.model_loader.tokenizer import chat_input_ids, tokenizer_class_name, tokenizer_info

TEXTS = ["The capital of France is", "  spaces\tand\nlines ", "naïve café 東京 🙂", "<|im_end|>x"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _load(caplog: pytest.LogCaptureFixture):
    """The tokenizer, and whether it came from the cache."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="replaylm.model_loader.gguf_tokenizer"):
        tokenizer = load_gguf_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    return tokenizer, "tokenizer loaded from the cache" in caplog.text


def test_a_cached_tokenizer_behaves_as_the_built_one(cache_dir, caplog):
    built, from_cache = _load(caplog)
    assert not from_cache
    (entry,) = (cache_dir / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    cached, from_cache = _load(caplog)
    assert from_cache and isinstance(cached, FastTokenizer)
    assert tokenizer_class_name(cached) == type(built).__name__
    for text in TEXTS:
        ids = built(text)["input_ids"]
        assert cached(text)["input_ids"] == ids
        assert cached.decode(ids) == built.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == built.decode(
            ids, skip_special_tokens=True
        )
    assert chat_input_ids(cached, MESSAGES) == chat_input_ids(built, MESSAGES)
    assert (cached.bos_token_id, cached.eos_token_id, cached.pad_token_id) == (
        built.bos_token_id,
        built.eos_token_id,
        built.pad_token_id,
    )
    assert tokenizer_info(cached) == tokenizer_info(built)


def test_a_damaged_entry_is_built_again(cache_dir, caplog):
    built, _ = _load(caplog)
    (entry,) = (cache_dir / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")
    rebuilt, from_cache = _load(caplog)
    assert not from_cache and "cannot read the cached tokenizer" in caplog.text
    assert rebuilt(TEXTS[0])["input_ids"] == built(TEXTS[0])["input_ids"]
    assert _load(caplog)[1]  # kept again


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # a file: no folder can be made under it
    tokenizer, from_cache = _load(caplog)
    assert not from_cache and "cannot cache the tokenizer" in caplog.text
    assert tokenizer.decode(tokenizer(TEXTS[0])["input_ids"]) == TEXTS[0]
