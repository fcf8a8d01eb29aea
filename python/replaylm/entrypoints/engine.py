"""Offline Engine: load a model once, then generate for batches of prompts in-process.

engine = Engine(model_path="smollm2-135m-instruct")
out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
out["text"], out["output_ids"], out["meta_info"]["finish_reason"]

With `tp_size=N` the model is split over N ranks: this process is rank 0 and spawns the others,
which follow its scheduler as the server's do (`runtime/scheduler_process.py`); `shutdown()`
ends them.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, overload

from replaylm.distributed.peer_all_reduce import all_reduce_for_rank_zero, met_peers
from replaylm.model_executor.engine_config import EngineConfig, resolve_engine_config
from replaylm.model_loader.builtin_models import DEFAULT_MODEL
from replaylm.model_loader.tokenizer import chat_input_ids, text_decoder, tokenizer_info
from replaylm.runtime.io_struct import FlushCacheReq, ShutdownReq, TokenizedGenerateReq
from replaylm.runtime.model_setup import load_runner_and_tokenizer
from replaylm.runtime.request import Req, truncate_at_stop
from replaylm.runtime.request_limits import check_input_ids, check_vocab_ids, clamp_max_new_tokens
from replaylm.runtime.scheduler import Scheduler
from replaylm.runtime.scheduler_loop import request_of
from replaylm.runtime.scheduler_process import (
    spawn_followers,
    stop_processes,
    with_dist_init_addr,
)
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs
from replaylm.speculative.stats import spec_meta_info
from replaylm.startup_stages import StartupStages

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from replaylm.model_loader.tokenizer import HFTokenizer
    from replaylm.structured.compiler import GrammarCompiler
    from replaylm.structured.grammar import RequestGrammar

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
TokenIds = list[int] | list[list[int]] | None
ParamsArg = dict[str, Any] | list[dict[str, Any]] | None


def _one_prompt(input_ids: list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """Whether `input_ids` holds one prompt's ids (not one list of ids per prompt)."""
    return bool(input_ids) and isinstance(input_ids[0], int)


class Engine:
    """`Engine(model_path=..., **server_args)`; keyword arguments are ServerArgs fields, but
    `startup_stages`: the process's start-up stages, which its construction goes on marking
    (default: its own, from the construction on), kept as `startup`."""

    def __init__(
        self,
        model_path: str = DEFAULT_MODEL,
        *,
        startup_stages: StartupStages | None = None,
        **kwargs: Any,
    ) -> None:
        self.startup = startup_stages or StartupStages("engine")
        args = ServerArgs(model_path=model_path, **kwargs)
        args.validate()
        if args.nnodes > 1:
            raise ValueError("the offline Engine runs every tensor-parallel rank here: nnodes 1")
        resolved = dataclasses.replace(resolve_engine_config(args), offline=True)
        self.config = with_dist_init_addr(_rank_zero_all_reduce(resolved))
        self.config.log()
        self.server_args = self.config.args  # with the defaults resolved for the device
        # the other ranks load alongside this one, and follow its scheduler
        self._followers = spawn_followers(self.config, range(1, args.tp_size))
        self.runner, self.draft_runner, self.tokenizer, self.eos_token_ids = (
            load_runner_and_tokenizer(self.config, self.startup)
        )
        if self._followers:
            from replaylm.distributed.communication import broadcast_objects

            broadcast_objects([tokenizer_info(self.tokenizer)])
        self._seed_rng = random.Random(self.server_args.seed)
        self._next_rid = 0
        self._decode = text_decoder(self.tokenizer) if self.tokenizer is not None else None
        self._grammar: GrammarCompiler | None = None  # made for the first constrained request
        self._rank_grammars: _RankGrammars | None = None  # with other ranks, likewise
        self.scheduler = Scheduler.from_args(
            self.runner,
            self.eos_token_ids,
            self._decode,
            self.server_args,
            self.draft_runner,
            offline=self.config.offline,
        )
        self.startup.mark("scheduler")
        self.startup.log_summary()

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` through the tokenizer's chat template, ready for a reply."""
        return chat_input_ids(self._require_tokenizer(), messages)

    @overload
    def generate(
        self, prompt: str, sampling_params: ParamsArg = None, input_ids: None = None
    ) -> dict[str, Any]: ...

    @overload
    def generate(
        self, prompt: list[str], sampling_params: ParamsArg = None, input_ids: None = None
    ) -> list[dict[str, Any]]: ...

    @overload
    def generate(
        self, prompt: None = None, sampling_params: ParamsArg = None, *, input_ids: list[int]
    ) -> dict[str, Any]: ...

    @overload
    def generate(
        self,
        prompt: None = None,
        sampling_params: ParamsArg = None,
        *,
        input_ids: list[list[int]],
    ) -> list[dict[str, Any]]: ...

    @overload
    def generate(
        self, prompt: Prompt = None, sampling_params: ParamsArg = None, input_ids: TokenIds = None
    ) -> dict[str, Any] | list[dict[str, Any]]: ...

    def generate(
        self, prompt: Prompt = None, sampling_params: ParamsArg = None, input_ids: TokenIds = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list (returns a list, same order).

        Give either `prompt` (text) or `input_ids`. `sampling_params` is one dict for all
        requests or one per request (SamplingParams fields). Each result holds `text`,
        `output_ids` and `meta_info` (prompt/completion token counts, finish_reason).
        """
        single, id_lists = self._inputs(prompt, input_ids)
        params_list = self._params(sampling_params, len(id_lists))
        msgs = [self._request_msg(ids, p) for ids, p in zip(id_lists, params_list, strict=True)]
        if self._followers and any(m.sampling_params.constraint for m in msgs):
            # every message is valid (its grammar compiled): from here on the ranks load them
            msgs = self._grammars_for_ranks().leave_out_held(msgs)
        reqs = [request_of(msg, self._request_grammar(msg)) for msg in msgs]
        for req in reqs:
            self.scheduler.add(req)
        if self._followers:
            self._run_with_followers(msgs)
        else:
            self.scheduler.run_to_completion()
        results = [self._result(r) for r in reqs]
        return results[0] if single else results

    def _run_with_followers(self, msgs: list[TokenizedGenerateReq]) -> None:
        """`run_to_completion` with the other ranks in step: each of their loop iterations takes
        rank 0's messages, then steps while there is work; so does this loop."""
        from replaylm.distributed.communication import broadcast_objects

        broadcast_objects([(0, msg) for msg in msgs])  # all from front end 0
        while self.scheduler.has_work:
            self.scheduler.step()
            if self.scheduler.has_work:
                broadcast_objects([])

    def flush_cache(self) -> int:
        """Evict every cached prefix (on every tensor-parallel rank: their caches must stay
        alike, or the ranks would batch differently); the number of tokens freed."""
        if self._followers:
            from replaylm.distributed.communication import broadcast_objects

            broadcast_objects([(0, FlushCacheReq())])
        return self.scheduler.prefix_cache.flush()

    def shutdown(self) -> None:
        """End the other tensor-parallel ranks' processes (none with tp_size 1). Safe to call
        twice; the Engine generates nothing after it."""
        if self._followers:
            from replaylm.distributed.communication import broadcast_objects, part_together

            broadcast_objects([(0, ShutdownReq())])
            self.runner.free_cuda_graphs()  # as the followers do on the shutdown message
            part_together()
            stop_processes(list(self._followers.values()), timeout_s=10)
            self._followers = {}

    def _require_tokenizer(self) -> HFTokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"model '{self.server_args.model_path}' has no tokenizer: pass input_ids, "
                "or --tokenizer-path"
            )
        return self.tokenizer

    def _inputs(self, prompt: Prompt, input_ids: TokenIds) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            tokenizer = self._require_tokenizer()
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids = [tokenizer(p)["input_ids"] for p in prompts]
            return isinstance(prompt, str), ids
        assert input_ids is not None  # exactly one of the two is given (checked above)
        if _one_prompt(input_ids):
            return True, [list(input_ids)]
        return False, [list(x) for x in input_ids]

    @staticmethod
    def _params(sampling_params: ParamsArg, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
            return [SamplingParams.from_dict(p) for p in sampling_params]
        return [SamplingParams.from_dict(sampling_params or {}) for _ in range(n)]

    def _request_msg(self, ids: list[int], params: SamplingParams) -> TokenizedGenerateReq:
        """The request as the scheduler processes get theirs (so the other ranks can make the
        same `Req` of it)."""
        vocab_size, kv = self.runner.config.vocab_size, self.runner.kv
        check_input_ids(ids, vocab_size, kv.context_len, kv.size)
        check_vocab_ids(params, vocab_size)
        max_new = clamp_max_new_tokens(len(ids), params.max_new_tokens, kv.context_len, kv.size)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        rid, self._next_rid = str(self._next_rid), self._next_rid + 1
        # with other ranks, the grammar travels compiled and serialized, as a server sends it
        grammar = None
        if params.constraint is not None and self._followers:
            grammar = self._compiler(params).compile(params)
        return TokenizedGenerateReq(
            [rid], list(ids), params, [seed], max_new, top_logprobs=None, grammar=grammar
        )

    def _compiler(self, params: SamplingParams) -> GrammarCompiler:
        """The grammar compiler (made for the first constrained request); ValueError naming
        `params`' constraint when the grammar engine cannot read the tokenizer."""
        from replaylm.structured.compiler import GrammarCompiler

        assert params.constraint is not None  # only a constrained request needs the compiler
        if self._grammar is None:
            vocab_size = self.runner.config.vocab_size
            self._grammar = GrammarCompiler.for_tokenizer(self._require_tokenizer(), vocab_size)
            if self._grammar is None:
                raise ValueError(
                    f"{params.constraint[0]}: the grammar engine cannot read the tokenizer"
                )
        return self._grammar

    def _grammars_for_ranks(self) -> _RankGrammars:
        if self._rank_grammars is None:
            assert self._grammar is not None  # the messages' grammars compiled with it
            vocabulary = self._grammar.description
            vocab_size = self.runner.config.vocab_size
            self._rank_grammars = _RankGrammars(vocabulary, vocab_size, self.eos_token_ids)
        return self._rank_grammars

    def _request_grammar(self, msg: TokenizedGenerateReq) -> RequestGrammar | None:
        """The grammar of the request's structured-output constraint (None without one);
        ValueError naming the field when it is invalid. With other ranks: loaded from the
        message as theirs is, so every rank's matcher is the same."""
        params = msg.sampling_params
        if params.constraint is None:
            return None
        if self._followers:
            return self._grammars_for_ranks().load(msg)
        from replaylm.structured.grammar import RequestGrammar

        compiled = self._compiler(params).compile_grammar(params)
        assert compiled is not None  # there is a constraint
        return RequestGrammar.start(compiled, self.eos_token_ids)

    def _result(self, req: Req) -> dict[str, Any]:
        text = self._decode(req.output_ids) if self._decode is not None else None
        if text is not None:
            text = truncate_at_stop(text, req.finish_reason)
        return {
            "text": text,
            "output_ids": list(req.output_ids),
            "meta_info": {
                "prompt_tokens": len(req.input_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
                "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
                **spec_meta_info(req.spec_verify_ct, req.spec_accepted),
            },
        }


class _RankGrammars:
    """Rank 0's side of the grammars an Engine with other ranks sends them: the loader that
    makes rank 0's matchers from the messages as the other ranks' loaders do, and the record
    of what those loaders hold, so a message goes without a grammar they have (a grammar is
    megabytes, and every message is broadcast). The first grammar takes the vocabulary along,
    as a server's does."""

    def __init__(self, vocabulary: str, vocab_size: int, eos: Collection[int]) -> None:
        from replaylm.structured.cache import HeldGrammars
        from replaylm.structured.loader import GrammarLoader

        self.loader = GrammarLoader(vocab_size, eos, description=vocabulary)
        self.held = HeldGrammars()
        self._vocabulary = vocabulary

    def leave_out_held(self, msgs: list[TokenizedGenerateReq]) -> list[TokenizedGenerateReq]:
        """`msgs`, each without its grammar where the loaders hold it by then (in order), the
        first with a grammar bringing the vocabulary."""
        out = []
        for msg in msgs:
            constraint = msg.sampling_params.constraint
            if constraint is not None:
                msg = self.held.outgoing(msg, self._vocabulary)
                self.held.sent(constraint)
            out.append(msg)
        return out

    def load(self, msg: TokenizedGenerateReq) -> RequestGrammar:
        constraint = msg.sampling_params.constraint
        assert constraint is not None
        return self.loader.load(constraint, msg.grammar)


def _rank_zero_all_reduce(config: EngineConfig) -> EngineConfig:
    """`config` with the all-reduce every rank takes when this process is rank 0 of a new
    group (`all_reduce_for_rank_zero`), logged where it differs from the asked one."""
    args = config.args
    if args.tp_size == 1:
        return config
    choice, why = all_reduce_for_rank_zero(args.tp_all_reduce, met_peers())
    if why is None:
        return config
    logger.info("tensor-parallel sums: %s (%s)", choice, why)
    return dataclasses.replace(config, args=dataclasses.replace(args, tp_all_reduce=choice))
