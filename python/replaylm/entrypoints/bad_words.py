"""vLLM's `bad_words` as the token ids they ban, tokenized as vLLM tokenizes them: each word
without, then with, a leading space (the spaced form only where its first token is new and its
length the same). Only single-token words are honoured: banning a longer word's last token after
its others needs each step's generated tokens on the host, which the overlap schedule lacks."""

from __future__ import annotations

from typing import Protocol

from replaylm.runtime.errors import RequestError


class Encode(Protocol):
    """Text to token ids (TokenizerManager.encode)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def bad_word_ids(words: list[str], encode: Encode) -> list[int]:
    """The ids `words` ban. RequestError naming `bad_words` for an empty word or one of several
    tokens."""
    banned: list[int] = []
    for word in words:
        plain = encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise RequestError(f"bad_words cannot hold an empty word, got {word!r}", "bad_words")
        spaced = encode(" " + word.lstrip(), add_special_tokens=False)
        forms = [plain]
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            forms.append(spaced)
        for ids in forms:
            if len(ids) > 1:
                raise RequestError(
                    f"bad_words: {word!r} is {len(ids)} tokens {ids}; only single-token words "
                    "are supported",
                    "bad_words",
                )
            banned += ids
    return banned
