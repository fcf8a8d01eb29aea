"""Tokenizer loading for every model-path kind the loader accepts, and the tokenizer's share
that the scheduler process needs (a stop-string decoder and the EOS id) without transformers.

A tokenizer is a transformers one or, for a GGUF file's cached tokenizer, a `FastTokenizer`
standing for one (`fast_tokenizer`: the same results without importing transformers)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.fast_tokenizer import FastTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    HFTokenizer = PreTrainedTokenizerBase | FastTokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Decoder = Callable[[list[int]], str]
StreamStep = Callable[[list[int]], str | None]  # an output's next ids -> the text they complete


@dataclass
class TokenizerInfo:
    """Sent once, first: the tokenizer manager's tokenizer as the scheduler needs it.

    `has_tokenizer` False: the model takes token ids only. `fast_json`: the tokenizers-library
    definition, which decodes stop-string text exactly as the manager's tokenizer does; None with
    a tokenizer means the scheduler loads the tokenizer itself. `eos_token_id` joins the model
    config's EOS ids. (The grammar engine's vocabulary comes later, with the first grammar:
    `TokenizedGenerateReq.grammar_vocabulary`.)
    """

    has_tokenizer: bool
    eos_token_id: int | None
    fast_json: str | None = None


def load_tokenizer(path: str) -> HFTokenizer | None:
    """The tokenizer of a model path, or None when the path holds none (a config-only folder
    used with dummy weights: such a model takes token ids only)."""
    path = resolve_model_path(path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        from replaylm.model_loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        # imported here: transformers takes seconds to import, and only a model with a
        # tokenizer needs it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return None


def tokenizer_class_name(tokenizer: HFTokenizer) -> str:
    """The transformers class of `tokenizer` (of a FastTokenizer: the one it stands for)."""
    return (
        tokenizer.class_name if isinstance(tokenizer, FastTokenizer) else type(tokenizer).__name__
    )


def chat_input_ids(
    tokenizer: HFTokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    tools: list[Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, by default ready for a
    reply. `continue_final_message`: the last message is left open for the model to continue
    (no generation prompt then); `add_special_tokens`: the tokenizer's own special tokens (BOS)
    on top of what the template writes; `tools`: the declared tools, as HF templates take them;
    `template_kwargs`: further variables for the template (such as Qwen3's `enable_thinking`)."""
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **(template_kwargs or {}),
    )
    assert isinstance(text, str)  # tokenize=False: the rendered text
    # what apply_chat_template(tokenize=True) does, with the special tokens made a choice
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def text_decoder(tokenizer: Any) -> Decoder:
    """`ids -> text` without special tokens: what the detokenizer shows and stop strings match."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return decode


def token_decoder(
    tokenizer: Any,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    backend: bool = False,
) -> Decoder:
    """`ids -> text` under these decode options (the second has an effect on slow tokenizers
    only, as in transformers). `backend`: the tokenizer decodes as its tokenizers-library
    backend does (`decodes_as_backend`), whose own decode then stands in, a third of the cost
    of transformers' wrapper (the streaming detokenizer calls it twice per token)."""
    if backend:
        fast = tokenizer.backend_tokenizer
        return lambda ids: fast.decode(ids, skip_special_tokens=skip_special_tokens)
    options = {
        "skip_special_tokens": skip_special_tokens,
        "spaces_between_special_tokens": spaces_between_special_tokens,
    }
    return lambda ids: tokenizer.decode(ids, **options)


def stream_step(tokenizer: Any, skip_special_tokens: bool = True) -> StreamStep:
    """A new incremental decode of one output through the tokenizers backend's `DecodeStream`:
    `ids -> the text they complete` (None while a character is incomplete), one call into the
    backend per step where a windowed decode takes two. For a tokenizer that decodes as its
    backend does (`decodes_as_backend`)."""
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    backend = tokenizer.backend_tokenizer

    def step(ids: list[int]) -> str | None:
        if len(ids) == 1:  # a decode step's token
            return stream.step(backend, ids[0])
        pieces = [stream.step(backend, token) for token in ids]  # one id a call: any release
        return None if all(p is None for p in pieces) else "".join(p or "" for p in pieces)

    return step


def decodes_as_backend(tokenizer: Any) -> bool:
    """Whether `tokenizer` is a fast tokenizer that decodes as its tokenizers-library backend
    does: no clean-up of spaces on top (checked on a probe text where clean-up changes it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    ids = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
    return bool(backend.decode(ids, skip_special_tokens=True) == text_decoder(tokenizer)(ids))


# text on which transformers' clean-up of tokenization spaces (" ." -> ".", " n't" -> "n't", ...)
# changes a decode, where it is on
_CLEANUP_PROBE = "it is done . is it ? yes ! a , b don't I 'm it 's we 've they 're"


def tokenizer_info(tokenizer: HFTokenizer | None) -> TokenizerInfo:
    """What the scheduler process needs of `tokenizer`. A fast tokenizer that decodes as its
    tokenizers-library backend does (no clean-up of spaces on top: checked on a probe text)
    travels as that backend's JSON; any other asks the scheduler to load the tokenizer itself
    (slower: transformers' import)."""
    if tokenizer is None:
        return TokenizerInfo(has_tokenizer=False, eos_token_id=None)
    fast_json = tokenizer.backend_tokenizer.to_str() if decodes_as_backend(tokenizer) else None
    return TokenizerInfo(
        has_tokenizer=True, eos_token_id=tokenizer.eos_token_id, fast_json=fast_json
    )


def scheduler_decoder(info: TokenizerInfo, path: str) -> Decoder | None:
    """The scheduler's stop-string decoder for `info`; None when there is no tokenizer. `path`
    (the tokenizer's location) is loaded only when the tokenizer did not travel as JSON."""
    if not info.has_tokenizer:
        return None
    if info.fast_json is not None:
        from tokenizers import Tokenizer

        return text_decoder(Tokenizer.from_str(info.fast_json))
    return text_decoder(load_tokenizer(path))
