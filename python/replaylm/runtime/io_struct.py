"""Messages between the HTTP layer, the tokenizer manager and the scheduler process.

Everything here is a plain picklable dataclass: the tokenizer manager (main process) sends
`TokenizerInfo` once (defined with the tokenizer loading, `model_loader/tokenizer.py`), then
`TokenizedGenerateReq` / `AbortReq` to the scheduler (child process), which answers
`SchedulerReady` once and then each step with one `BatchTokenOut`. The tokenizer manager turns
those into `GenerateOutput`s (text deltas) for the HTTP layer, or for a stream that gave it a
`TextFrame`, most of them straight into the bytes the stream sends (and, once its response has
begun, onto its connection).
"""

from __future__ import annotations

import dataclasses
import pickle
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replaylm.model_executor.forward_stats import ExpertTokens, ForwardStats
from replaylm.runtime.request import FinishReason
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.stats import SpeculationStats

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

MAX_TOP_LOGPROBS = 20


def send_message(conn: Connection, msg: object) -> None:
    """`conn.send(msg)` without its ForkingPickler: that copies the reducer table (torch adds
    dozens of reducers) for every message, which costs more than pickling a request or a step's
    outputs; these messages need none of them. `conn.recv()` reads it."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass
class GenerateRequest:
    """What the HTTP layer asks for: token ids (already tokenized / chat-templated).

    `top_logprobs`: None = no logprobs; k >= 0 = the sampled token's logprob plus the k most likely
    alternatives (k <= MAX_TOP_LOGPROBS) for every generated token. `prompt_logprobs`: the same for
    every prompt token after the first (the first has none). `n`: independent samples of the
    prompt, prefilled once; choice i samples with seed `seed + i` when a seed is given.
    """

    input_ids: list[int]
    sampling_params: SamplingParams
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)


# writes a stream's event at once: None once written, else an awaitable that finishes the write
FrameSend = Callable[[bytes], Awaitable[None] | None]


class TextFrame:
    """A stream's text-only increments (`TokenizerManager.generate`'s frames): `render(index,
    text)` gives the bytes the stream sends for new text of choice `index` and nothing else (one
    server-sent event), rendered where the scheduler's message is read; until it is set (a
    stream whose templates need the started request), such increments come whole. `send`, set by
    the stream while its response is open, writes such bytes at once (a frame that finds the
    stream idle then costs it no task wake)."""

    def __init__(self, render: Callable[[int, str], bytes] | None = None) -> None:
        self.render = render
        self.send: FrameSend | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class GenerateOutput:
    """One increment of a request's output: the text and tokens new since the previous one.

    The last increment has `finish_reason` set (type `stop`, `length` or `abort`). Text never
    includes a matched stop string, and no text that might still turn out to be the start of a
    stop string is released before it is decided.
    """

    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    index: int = 0  # which of the request's `n` choices this increments
    # the choice's first increment, when asked: one entry per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV was reused rather than computed
    spec_verify_ct: int = 0  # speculative decoding: verify steps of the choice so far
    spec_accepted: int = 0  # and the draft tokens accepted in them

    def then(self, later: GenerateOutput) -> GenerateOutput:
        """This increment and the next one of the same choice, as one."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return dataclasses.replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


# ---- main process -> scheduler process ----------------------------------------------------


@dataclass
class TokenizedGenerateReq:
    """`rids`: one per choice (`n` of them), each with its own seed; `grammar`: the compiled
    structured-output grammar, serialized (xgrammar's JSON), None without a constraint or when
    the scheduler holds the constraint's grammar from an earlier request (`HeldGrammars`).
    `grammar_vocabulary`: the vocabulary grammars are compiled against
    (`structured.vocabulary`), sent once, with the first grammar (the manager describes it only
    when structured output is first asked for)."""

    rids: list[str]
    input_ids: list[int]
    sampling_params: SamplingParams
    seeds: list[int]
    max_new_tokens: int
    top_logprobs: int | None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    grammar_vocabulary: str | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class ShutdownReq:
    pass


@dataclass
class FlushCacheReq:
    """Evict every cached prefix no request holds."""


# ---- scheduler process -> main process ----------------------------------------------------


@dataclass
class SchedulerReady:
    """Sent once the model is loaded; sizes the tokenizer manager validates requests against."""

    max_total_tokens: int
    context_len: int
    vocab_size: int
    cuda_graph_capture: dict[str, dict[str, Any]]  # ModelRunner.cuda_graph_stats()
    startup: dict[str, Any]  # the scheduler process's StartupStages.to_dict()
    chunked_prefill_size: int  # the chunk the scheduler took (the model's default unless given)


@dataclass
class SchedulerFailed:
    """Sent instead of SchedulerReady (or later) when the scheduler process cannot go on."""

    error: str


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    num_retractions: int
    forward_stats: ForwardStats = field(default_factory=ForwardStats)
    grammar_steps: int = 0  # sampling steps that masked a structured-output request's logits
    grammar_host_s: float = 0.0  # host time of the grammar engine so far (feeding, bitmasks)
    prefix_prompt_tokens: int = 0  # prompt tokens admitted so far (first admissions)
    prefix_cached_tokens: int = 0  # of them, found in the prefix cache
    prefix_cache_tokens: int = 0  # KV slots the prefix cache holds now
    speculation: SpeculationStats | None = None  # None: speculative decoding is off
    expert_tokens: ExpertTokens | None = None  # None: a dense model


@dataclass
class ReqTokenOut:
    """A request's tokens produced in one step (or its abort / finish). `admitted_at`: the
    wall-clock time (`time.time()`, comparable across processes) of the request's first
    admission to a prefill batch, for the queue and prefill time metrics."""

    rid: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0
    admitted_at: float | None = None
    spec_verify_ct: int = 0
    spec_accepted: int = 0


@dataclass
class FlushCacheOut:
    freed_tokens: int


# a step's tokens for a request past its first ones, with nothing else to say: (rid, new ids);
# its front end takes the rest from the request's last ReqTokenOut
PlainTokenOut = tuple[str, list[int]]


@dataclass
class BatchTokenOut:
    """One step's outputs, sent to each front end every step. Most are PlainTokenOut (a decode
    step's token); a ReqTokenOut pickles as a plain tuple of its fields. Both cost a fraction of
    what a list of dataclasses does, in the scheduler and in the front end."""

    outputs: list[ReqTokenOut | PlainTokenOut]
    stats: SchedulerStats

    def __reduce__(self) -> tuple[Any, ...]:
        rows = [
            out if isinstance(out, tuple) else tuple(vars(out).values()) for out in self.outputs
        ]
        return _batch_from_rows, (rows, self.stats)


def _batch_from_rows(rows: list[tuple[Any, ...]], stats: SchedulerStats) -> BatchTokenOut:
    outputs = [row if len(row) == 2 else ReqTokenOut(*row) for row in rows]
    return BatchTokenOut(outputs, stats)  # the 2-tuples are PlainTokenOut
