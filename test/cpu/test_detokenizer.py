"""Incremental detokenization against a real tokenizer (the built-in SmolLM2's byte-level BPE)."""

from __future__ import annotations

import pytest

from replaylm.model_loader.tokenizer import decodes_as_backend, load_tokenizer, token_decoder
from replaylm.runtime.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, héllo wörld! 日本語のテキスト 🎉🎉 done.",
    "  leading spaces\n\nnew lines\ttabs and  double  spaces",
    "emoji 👩‍👩‍👧 family and 🇫🇷 flag",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(params=["transformers", "backend"])
def decoder(request, tokenizer):
    """`decoder(skip)`: the server's decode through transformers, and through the tokenizers
    backend (what the server takes for this tokenizer, which decodes as its backend does)."""
    backend = request.param == "backend"
    assert decodes_as_backend(tokenizer)
    return lambda skip=True: token_decoder(tokenizer, skip, backend=backend)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str, list[str]]:
    sent, deltas = 0, []
    for token in ids:
        detok.add([token])
        shown = detok.releasable()
        assert shown.startswith("".join(deltas))  # released text is never taken back
        deltas.append(shown[sent:])
        sent = len(shown)
    return "".join(deltas), deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_decoding_all_at_once(tokenizer, decoder, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    streamed, deltas = _stream(IncrementalDetokenizer(decoder(), []), ids)
    assert streamed == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # no half characters ever shown


def test_stop_string_is_never_released(tokenizer, decoder):
    text = "The answer is 42. STOP here and more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(decoder(), ["STOP", "never"])
    released = ""
    for token in ids:  # as the scheduler does: stop at the first token completing "STOP"
        detok.add([token])
        if "STOP" in detok.text:
            break
        released = detok.releasable()
    assert "The answer is 42. ".startswith(released) and len(released) >= 10
    assert detok.final_text("STOP") == "The answer is 42. "


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_shown_only_when_asked(tokenizer, decoder, skip):
    """`skip_special_tokens=False` streams the chat markers too, as decoding all at once does."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=True, return_dict=False
    )
    streamed, _ = _stream(IncrementalDetokenizer(decoder(skip), []), ids)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in streamed) is not skip
