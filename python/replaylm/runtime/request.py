"""Req: one generation request's state as it moves through prefill and decode."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from replaylm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from replaylm.mem_cache.radix_cache import TreeNode
    from replaylm.structured.grammar import RequestGrammar


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped: `length` (max_new_tokens or context), `stop` (EOS, a stop token
    id, or a stop string: `matched` says which) or `abort` (`matched` holds the reason)."""

    type: Literal["length", "stop", "abort"]
    matched: int | str | None = None

    def to_dict(self) -> dict[str, object]:
        return {"type": self.type, "matched": self.matched}


@dataclass
class PromptLogprobChunk:
    """Scores of prompt positions `start .. end - 1` (targets: tokens `start + 1 .. end`), host
    tensors that are complete once the step that computed them has been read back
    (`prompt_logprobs.py` computes them)."""

    start: int
    end: int
    chosen: torch.Tensor  # [end - start] float32
    top_vals: torch.Tensor  # [end - start, k] float32
    top_ids: torch.Tensor  # [end - start, k] int64


@dataclass
class Req:
    """`kv_slots`: the KV slots of the first tokens of `input_ids + output_ids`, those whose K/V
    are cached (or being written by a step in flight), in order: the host's copy of the request's
    row of the request table, so freeing them reads nothing back from the device. The first
    `shared_len` of them belong to the prefix cache (locked at `prefix_node` while the request
    holds them); the request frees only the rest."""

    rid: Hashable  # compared only; the scheduler process's are (front end, its id)
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    top_logprobs: int | None = None  # None: no logprobs; k: sampled token's + k alternatives
    # None: none; k: each prompt token's logprob (after the first) + k alternatives
    prompt_logprobs: int | None = None
    prompt_logprob_chunks: list[PromptLogprobChunk] = field(default_factory=list)
    # the other choices of an `n > 1` request, (rid, seed) each: forked once the prompt is cached
    forks: list[tuple[Hashable, int]] = field(default_factory=list)
    admitted_at: float | None = None  # time.time() of its first admission to a prefill batch
    grammar: RequestGrammar | None = None  # structured output: the grammar the output follows
    prefix_node: TreeNode | None = None  # the prefix cache's node its shared slots end at
    shared_len: int = 0
    cached_tokens: int = 0  # prompt tokens its first prefill found cached (usage reports them)
    draft_state: object | None = None  # speculative decoding: its drafter's own state
    spec_verify_ct: int = 0  # verify steps it took part in
    spec_accepted: int = 0  # draft tokens of its accepted in them

    @property
    def prompt_logprobs_done(self) -> int:
        """Prompt positions whose next token's logprob is computed (each predicts the next)."""
        chunks = self.prompt_logprob_chunks
        return chunks[-1].end if chunks else 0

    def fork(self, rid: Hashable, seed: int) -> Req:
        """A new choice of this request: same prompt and settings, its own id and seed."""
        return Req(
            rid,
            self.input_ids,
            self.sampling_params,
            seed,
            self.max_new_tokens,
            top_logprobs=self.top_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            prompt_logprob_chunks=self.prompt_logprob_chunks,
            admitted_at=self.admitted_at,
            grammar=self.grammar.fork() if self.grammar is not None else None,
        )

    @property
    def kv_len(self) -> int:
        """How many of the request's tokens are cached."""
        return len(self.kv_slots)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def id_slice(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` for 0 <= start <= end, building only that slice (prompts of
        thousands of tokens are compared per request per step)."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[max(start - n, 0) : end - n]

    @property
    def num_ids(self) -> int:
        """`len(all_ids)`, without building the list (per request per step)."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def last_id(self) -> int:
        """`all_ids[-1]`, without building the list."""
        return self.output_ids[-1] if self.output_ids else self.input_ids[-1]

    @property
    def can_speculate(self) -> bool:
        """Whether its draft tokens can be checked at once: no logit adjustments (penalties,
        logit_bias, allowed or banned ids, min_tokens still holding EOS back), no grammar
        and no logprobs. The others decode one token a step inside a verify batch."""
        params = self.sampling_params
        return (
            self.grammar is None
            and self.top_logprobs is None
            and not params.adjusts_logits
            and len(self.output_ids) >= params.min_tokens
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token: int, eos_ids: frozenset[int], output_text: str | None) -> None:
        """Record a sampled token and decide whether the request is finished.

        `output_text` (the decoded output so far) is needed only when the request has stop
        strings; pass None otherwise.
        """
        self.output_ids.append(token)
        params = self.sampling_params
        if token in params.stop_token_ids or token in eos_ids and not params.ignore_eos:
            self.finish_reason = FinishReason("stop", token)
        elif output_text is not None and (hit := _first_stop(output_text, params.stop)):
            self.finish_reason = FinishReason("stop", hit)
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = FinishReason("length")


def _first_stop(text: str, stops: list[str]) -> str | None:
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits)[1] if hits else None


def truncate_at_stop(text: str, reason: FinishReason | None) -> str:
    """Drop a matched stop string and everything after it (stop strings are not emitted)."""
    if reason is not None and isinstance(reason.matched, str):
        return text[: text.find(reason.matched)]
    return text
