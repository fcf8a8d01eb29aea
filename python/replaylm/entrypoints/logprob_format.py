"""Logprobs as the API returns them: the completions (legacy) format, the chat format and vLLM's
`prompt_logprobs`. `token_text` decodes one token id; `as_ids` (vLLM's
`return_tokens_as_token_ids`) shows tokens by id instead, which identifies those that are not
valid UTF-8 on their own."""

from __future__ import annotations

from collections.abc import Callable

from replaylm.entrypoints.openai_responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)
from replaylm.runtime.io_struct import TokenLogprob

TokenText = Callable[[int], str]


def token_id_label(token_id: int) -> str:
    """A token as vLLM shows it under `return_tokens_as_token_ids`: `token_id:{id}`."""
    return f"token_id:{token_id}"


def completion_logprobs(
    entries: list[tuple[int, TokenLogprob | None]],
    k: int,
    offset: int,
    token_text: TokenText,
    as_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """Legacy-format logprobs of `entries` ((token id, its logprobs or None) each: None for the
    first token of an echoed prompt, which has nothing before it). Each position's
    `top_logprobs` holds the k most likely tokens and, as OpenAI's, the chosen one (so up to
    k + 1). `offset`: where the first token starts in the text; returns where the next would.
    `text_offset` counts the text's characters even `as_ids`, so it still indexes the text
    (vLLM's counts the labels' outside streams, and so disagrees with its own streams)."""
    label = token_id_label if as_ids else token_text
    out = CompletionLogprobs()
    for token_id, lp in entries:
        token = label(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token_text(token_id))
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for top_id, logprob in lp.top[:k]:
            top.setdefault(label(top_id), logprob)
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
    return out, offset


def chat_logprobs(
    lps: list[TokenLogprob], k: int, token_text: TokenText, as_ids: bool = False
) -> ChatLogprobs:
    """Chat-format logprobs: each token with its k most likely alternatives. `bytes` encode the
    token as shown, so its label `as_ids` (vLLM keeps the text's bytes for the chosen token)."""
    label = token_id_label if as_ids else token_text

    def entry(token_id: int, logprob: float) -> ChatTopLogprob:
        token = label(token_id)
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **entry(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[entry(t, v) for t, v in lp.top[:k]],
            )
            for lp in lps
        ]
    )


def prompt_logprobs(
    lps: list[TokenLogprob | None] | None, k: int, token_text: TokenText
) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), its own logprob and the
    k most likely tokens, keyed by token id, with their rank (None where it is not known: a
    prompt token outside the k most likely)."""
    if lps is None:
        return None
    out: PromptLogprobs = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        ranked = {
            str(t): PromptLogprob(logprob=v, rank=rank, decoded_token=token_text(t))
            for rank, (t, v) in enumerate(lp.top[:k], start=1)
        }
        own = ranked.get(str(lp.token_id)) or PromptLogprob(
            logprob=lp.logprob, rank=None, decoded_token=token_text(lp.token_id)
        )
        out.append({str(lp.token_id): own, **ranked})
    return out
