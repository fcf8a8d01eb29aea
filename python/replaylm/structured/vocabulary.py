"""The model's vocabulary as xgrammar sees it: built once from the tokenizer, sized to the model.

The manager describes its tokenizer before the model is loaded (its vocabulary size is not known
yet), so the description travels at the tokenizer's own size; each side then sizes it to the
model's vocabulary with the same function, which keeps both sides' descriptions identical (a
compiled grammar loads only against the description it was compiled with).
"""

from __future__ import annotations

import logging
from typing import Any

import xgrammar as xgr

from replaylm.model_loader.fast_tokenizer import FastTokenizer

logger = logging.getLogger(__name__)


def describe_vocabulary(tokenizer: Any) -> str | None:
    """xgrammar's description of `tokenizer`'s vocabulary, serialized; None (with a warning) for
    a tokenizer xgrammar cannot read, which leaves the server without structured output."""
    try:
        if isinstance(tokenizer, FastTokenizer):
            return _fast_tokenizer_info(tokenizer).serialize_json()
        return xgr.TokenizerInfo.from_huggingface(tokenizer).serialize_json()
    except Exception as err:  # whatever xgrammar trips on: the server still serves the rest
        logger.warning("structured output is off: xgrammar cannot read the tokenizer (%s)", err)
        return None


def _fast_tokenizer_info(tokenizer: FastTokenizer) -> xgr.TokenizerInfo:
    """What `TokenizerInfo.from_huggingface` makes of the transformers fast tokenizer that
    `tokenizer` stands for (xgrammar knows fast tokenizers by their transformers class), through
    the same steps: the vocabulary by id, the vocabulary type and prefix space read from the
    backend's JSON, or from the vocabulary itself where that clearly says otherwise."""
    vocab = tokenizer.get_vocab()
    size = max(len(vocab), max(vocab.values()) + 1)
    encoded = [""] * size
    for token, index in vocab.items():
        encoded[index] = token
    info = xgr.TokenizerInfo
    metadata = info._detect_metadata_from_hf(tokenizer.backend_tokenizer.to_str())
    vocab_type = info._detect_vocab_type_from_vocab(vocab)
    if vocab_type is not None and vocab_type != metadata["vocab_type"]:
        # it calls encode and convert_ids_to_tokens only, which FastTokenizer has
        prefix_space = info._detect_add_prefix_space_by_encoding(tokenizer, vocab_type)  # type: ignore[arg-type]
        metadata = {"vocab_type": vocab_type, "add_prefix_space": prefix_space}
    eos = tokenizer.eos_token_id
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=size,
        stop_token_ids=None if eos is None else [eos],
        add_prefix_space=metadata["add_prefix_space"],
    )


def sized_vocabulary(description: str, vocab_size: int) -> xgr.TokenizerInfo:
    """The vocabulary `description` (from `describe_vocabulary`) sized to the model's
    `vocab_size` rows of logits: ids the tokenizer lacks (padding) are empty tokens, which no
    grammar allows; tokenizer ids past the model's rows are dropped."""
    info = xgr.TokenizerInfo.deserialize_json(description)
    if info.vocab_size == vocab_size:
        return info
    vocab = info.decoded_vocab[:vocab_size]
    vocab += [b""] * (vocab_size - len(vocab))
    # the decoded tokens are raw bytes already: RAW keeps them as they are
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=vocab_size,
        stop_token_ids=[t for t in info.stop_token_ids if t < vocab_size] or None,
        add_prefix_space=info.add_prefix_space,
    )
