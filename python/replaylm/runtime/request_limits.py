"""Checks every new request passes before it is queued (Engine and TokenizerManager alike)."""

from __future__ import annotations

from replaylm.runtime.errors import RequestError
from replaylm.sampling_params import SamplingParams


def check_input_ids(ids: list[int], vocab_size: int, context_len: int, kv_tokens: int) -> None:
    """Raise RequestError for an empty prompt, ids outside the vocabulary, or a prompt that
    leaves no room for one generated token in the context or the KV cache."""
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    limit = min(context_len, kv_tokens)
    if len(ids) >= limit:
        what = "context length" if context_len <= kv_tokens else "KV cache size (tokens)"
        raise RequestError(
            f"the prompt has {len(ids)} tokens; the {what} is {limit}, which leaves no room "
            "for output",
            "prompt",
        )
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise RequestError(f"input_ids must be ints in [0, {vocab_size})", "input_ids")


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
    return min(requested, context_len - prompt_len, kv_tokens - prompt_len)
