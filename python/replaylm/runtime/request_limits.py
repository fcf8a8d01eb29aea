"""Checks every new request passes before it is queued (Engine and TokenizerManager alike), and
the context check the HTTP layer makes of a prompt and its requested output. Errors use OpenAI's
wording where it has one (a context overflow says "maximum context length" and carries the code
`context_length_exceeded`) and vLLM's elsewhere: clients match on both."""

from __future__ import annotations

from replaylm.runtime.errors import RequestError
from replaylm.sampling_params import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for an overflow


def _limit(context_len: int, kv_tokens: int) -> tuple[int, str]:
    """The tokens one request may hold in all, and the sentence that says so (OpenAI's, naming
    the KV cache where it, not the model, sets the limit)."""
    if context_len <= kv_tokens:
        return context_len, f"This model's maximum context length is {context_len} tokens."
    return kv_tokens, (
        f"This model's maximum context length is {kv_tokens} tokens (this server's KV cache size)."
    )


def check_input_ids(ids: list[int], vocab_size: int, context_len: int, kv_tokens: int) -> None:
    """Raise RequestError for an empty prompt, a prompt that leaves no room for one generated
    token in the context or the KV cache, or ids outside the vocabulary."""
    if not ids:
        raise RequestError("The prompt cannot be empty", "prompt")
    check_context(len(ids), None, context_len, kv_tokens, "prompt", "max_new_tokens")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"Token id {bad[0]} is out of vocabulary: input_ids must be ints in [0, {vocab_size})",
            "input_ids",
        )


def output_room(prompt_len: int, context_len: int, kv_tokens: int) -> int:
    """How many tokens a prompt of `prompt_len` tokens leaves for output."""
    return _limit(context_len, kv_tokens)[0] - prompt_len


def check_context(
    prompt_len: int,
    requested: int | None,
    context_len: int,
    kv_tokens: int,
    prompt_param: str,
    output_param: str,
) -> None:
    """RequestError (code `context_length_exceeded`) when a prompt of `prompt_len` tokens and
    `requested` output tokens (None: at least one) do not fit: naming `prompt_param` (also the
    message's word for the prompt: "prompt", "messages") where the prompt alone leaves no room,
    else `output_param`."""
    limit, opening = _limit(context_len, kv_tokens)
    if prompt_len + (requested or 1) <= limit:
        return
    if requested is None:
        message = (
            f"{opening} However, the prompt has {prompt_len} tokens, which leaves no room for the "
            f"completion. Please reduce the length of the {prompt_param}."
        )
    else:
        message = (
            f"{opening} However, you requested {prompt_len + requested} tokens ({prompt_len} in "
            f"the {prompt_param}, {requested} in the completion). Please reduce the length of "
            f"the {prompt_param} or completion."
        )
    param = prompt_param if prompt_len >= limit else output_param
    raise RequestError(message, param, CONTEXT_LENGTH_EXCEEDED)


def check_vocab_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise RequestError naming the field (`logit_bias`, `stop_token_ids`, ...) that holds a
    token id outside the vocabulary (validated params: the ids are ints >= 0)."""
    for name, ids in (
        ("logit_bias", list(params.logit_bias)),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or []),
        ("banned_token_ids", params.banned_token_ids),
    ):
        bad = sorted(t for t in ids if t >= vocab_size)
        if bad:
            raise RequestError(
                f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})", name
            )


def clamp_max_new_tokens(prompt_len: int, requested: int, context_len: int, kv_tokens: int) -> int:
    """The output budget: what was asked for, cut to what the context and KV cache can hold."""
    return min(requested, output_room(prompt_len, context_len, kv_tokens))
