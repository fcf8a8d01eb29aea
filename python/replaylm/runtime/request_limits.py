"""Checks every new request passes before it is queued (Engine and TokenizerManager alike), and
the output budget the HTTP layer checks a requested `max_tokens` against."""

from __future__ import annotations

from replaylm.runtime.errors import RequestError
from replaylm.sampling_params import SamplingParams


def _limit(context_len: int, kv_tokens: int) -> tuple[int, str]:
    """The tokens one request may hold in all, and what sets that limit."""
    if context_len <= kv_tokens:
        return context_len, "context length"
    return kv_tokens, "KV cache size (tokens)"


def check_input_ids(ids: list[int], vocab_size: int, context_len: int, kv_tokens: int) -> None:
    """Raise RequestError for an empty prompt, ids outside the vocabulary, or a prompt that
    leaves no room for one generated token in the context or the KV cache."""
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    limit, what = _limit(context_len, kv_tokens)
    if len(ids) >= limit:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; the {what} is {limit}, which leaves no room "
            "for output",
            "prompt",
        )
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise RequestError(f"input_ids must be ints in [0, {vocab_size})", "input_ids")


def output_room(prompt_len: int, context_len: int, kv_tokens: int) -> int:
    """How many tokens a prompt of `prompt_len` tokens leaves for output."""
    return _limit(context_len, kv_tokens)[0] - prompt_len


def check_max_new_tokens(
    prompt_len: int, requested: int, context_len: int, kv_tokens: int, param: str
) -> None:
    """RequestError naming `param` when `requested` output tokens do not fit after the prompt
    (a prompt that leaves no room at all is check_input_ids' error, so nothing is said here)."""
    room = output_room(prompt_len, context_len, kv_tokens)
    if 1 <= room < requested:
        limit, what = _limit(context_len, kv_tokens)
        raise RequestError(
            f"{param} is too large: {requested} tokens requested, but the {what} is {limit} and "
            f"the prompt has {prompt_len} tokens, which leaves room for {room} "
            f"({requested} > {limit} - {prompt_len})",
            param,
        )


def check_vocab_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise RequestError naming `logit_bias` or `stop_token_ids` when one holds a token id
    outside the vocabulary (validated params: the ids are ints >= 0)."""
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        bad = sorted(t for t in ids if t >= vocab_size)
        if bad:
            raise RequestError(
                f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})", name
            )


def clamp_max_new_tokens(prompt_len: int, requested: int, context_len: int, kv_tokens: int) -> int:
    """The output budget: what was asked for, cut to what the context and KV cache can hold."""
    return min(requested, output_room(prompt_len, context_len, kv_tokens))
