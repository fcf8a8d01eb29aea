"""Incremental detokenization against a real tokenizer (the built-in SmolLM2's byte-level BPE)."""

from __future__ import annotations

import pytest

from replaylm.model_loader.tokenizer import (
    decodes_as_backend,
    load_tokenizer,
    stream_step,
    token_decoder,
)
from replaylm.runtime.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, héllo wörld! 日本語のテキスト 🎉🎉 done.",
    "  leading spaces\n\nnew lines\ttabs and  double  spaces",
    "emoji 👩‍👩‍👧 family and 🇫🇷 flag",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(params=["transformers", "backend", "stream"])
def detokenizer(request, tokenizer):
    """`detokenizer(stop, skip)`: the server's detokenizer, decoding through transformers,
    through the tokenizers backend (what the server takes for this tokenizer, which decodes as
    its backend does), and streaming through the backend's DecodeStream (what it streams with)."""
    assert decodes_as_backend(tokenizer)
    backend = request.param != "transformers"

    def make(stop: list[str] | None = None, skip: bool = True) -> IncrementalDetokenizer:
        step = stream_step(tokenizer, skip) if request.param == "stream" else None
        return IncrementalDetokenizer(
            token_decoder(tokenizer, skip, backend=backend), stop or [], step
        )

    return make


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
def test_token_by_token_equals_decoding_all_at_once(tokenizer, detokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    streamed, deltas = _stream(detokenizer(), ids)
    assert streamed == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # no half characters ever shown


def test_stop_string_is_never_released(tokenizer, detokenizer):
    text = "The answer is 42. STOP here and more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = detokenizer(["STOP", "never"])
    released = ""
    for token in ids:  # as the scheduler does: stop at the first token completing "STOP"
        detok.add([token])
        if "STOP" in detok.text:
            break
        released = detok.releasable()
    assert "The answer is 42. ".startswith(released) and len(released) >= 10
    assert detok.final_text("STOP") == "The answer is 42. "


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_shown_only_when_asked(tokenizer, detokenizer, skip):
    """`skip_special_tokens=False` streams the chat markers too, as decoding all at once does."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=True, return_dict=False
    )
    streamed, _ = _stream(detokenizer(skip=skip), ids)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in streamed) is not skip


def test_an_output_ending_in_half_a_character_ends_as_decoding_all_does(tokenizer, detokenizer):
    ids = tokenizer("party 🎉", add_special_tokens=False)["input_ids"]
    cut = ids[:-1]  # the emoji's last byte never comes
    detok = detokenizer()
    for token in cut:
        detok.add([token])
    assert "\ufffd" not in detok.releasable()
    assert detok.final_text(None) == tokenizer.decode(cut)
    assert detok.final_text(None).endswith("\ufffd")


def test_a_stream_the_backend_refuses_falls_back_to_the_window(tokenizer):
    """The backend's DecodeStream raises on some sequences: the window then decodes the rest,
    from the text already released."""
    text = TEXTS[0]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = stream_step(tokenizer)
    calls = 0

    def failing(new_ids):
        nonlocal calls
        calls += 1
        if calls > 5:
            raise RuntimeError("invalid prefix")
        return stream(new_ids)

    decode = token_decoder(tokenizer, backend=True)
    streamed, _ = _stream(IncrementalDetokenizer(decode, [], failing), ids)
    assert streamed == text and calls == 6
