"""Checks every new request passes before it is queued (Engine and TokenizerManager alike)."""

from __future__ import annotations

from replaylm.runtime.errors import RequestError


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


def clamp_max_new_tokens(prompt_len: int, requested: int, context_len: int, kv_tokens: int) -> int:
    """The output budget: what was asked for, cut to what the context and KV cache can hold."""
    return min(requested, context_len - prompt_len, kv_tokens - prompt_len)
