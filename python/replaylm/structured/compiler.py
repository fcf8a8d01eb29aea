"""Compiling a request's structured-output constraint into an xgrammar grammar (manager side).

JSON schemas compile in xgrammar's strict mode whatever OpenAI's `strict` flag says, as vLLM and
SGLang do: no property or array item beyond those the schema declares, so every output validates
against the schema as written (what `strict: true` promises; `strict: false` promises nothing
less). Whitespace between JSON tokens is free and unbounded (xgrammar's `max_whitespace_cnt`
unset), as both leave it by default. A model whose prompt does not ask for JSON can pad it with
whitespace until its length runs out; a cap only moves that padding into the strings (an email of
repeated letters), while a prompt that asks for the JSON gets it compact: clients (and
benchmarks) should ask for it.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import xgrammar as xgr

from replaylm.sampling_params import SamplingParams
from replaylm.structured.cache import GRAMMARS_KEPT, Constraint, LruCache
from replaylm.structured.vocabulary import describe_vocabulary, sized_vocabulary

# compiled grammars kept for reuse (a request for a schema seen before compiles in no time)
CACHE_LIMIT_BYTES = 512 * 1024 * 1024

# xgrammar's errors start with its log prefix ("[12:34:56] /project/cpp/x.cc:83: ") and, for some,
# a failed check's condition ("Check failed: (...) is false: "): noise for the user
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false: ")
_ECHOED_INPUT = ". The JSON string is:"  # the whole input, appended to JSON parse errors


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary, caching compiled grammars (xgrammar's
    cache) and the serialized forms of the `GRAMMARS_KEPT` constraints used last. Thread-safe.
    `description`: the tokenizer's vocabulary from `describe_vocabulary` (kept: the scheduler's
    loader needs it to load the grammars)."""

    def __init__(self, description: str, vocab_size: int) -> None:
        self.description = description
        self.tokenizer_info = sized_vocabulary(description, vocab_size)
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        self.serialized: LruCache[Constraint, str] = LruCache(GRAMMARS_KEPT)
        # one serialization per constraint even when a burst of its requests misses at once
        self._serializing = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarCompiler | None:
        """A compiler for `tokenizer`'s vocabulary; None when xgrammar cannot read it."""
        description = describe_vocabulary(tokenizer)
        return cls(description, vocab_size) if description is not None else None

    def compile(self, params: SamplingParams) -> str | None:
        """`params`' constraint compiled and serialized (xgrammar's JSON), None without one.
        Raises ValueError, one line naming the field, when the constraint is invalid."""
        grammar = self.compile_grammar(params)
        if grammar is None:
            return None
        constraint = params.constraint
        assert constraint is not None  # it compiled
        with self._serializing:
            serialized = self.serialized.get(constraint)
            if serialized is None:
                serialized = grammar.serialize_json()
                self.serialized.put(constraint, serialized)
        return serialized

    def compile_grammar(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """`params`' constraint compiled (None without one); ValueError as in `compile`."""
        constraint = params.constraint
        if constraint is None:
            return None
        field, text = constraint
        try:
            if field == "json_schema":
                return self._compiler.compile_json_schema(text, strict_mode=True)
            if field == "regex":
                return self._compiler.compile_regex(text)
            if field == "ebnf":
                return self._compiler.compile_grammar(text)
            return self._compiler.compile_structural_tag(text)
        except (RuntimeError, ValueError, TypeError) as err:
            raise ValueError(f"invalid {field}: {_clean(str(err))}") from err


@functools.lru_cache(maxsize=256)  # agents send the same tools every turn: checked once each
def check_json_schema(schema: str) -> None:
    """ValueError (one line) unless xgrammar takes `schema` as requests' schemas compile (strict
    mode): the check, without the vocabulary, of a schema that is not compiled now, such as a
    tool's parameters where calls are not forced."""
    try:
        xgr.Grammar.from_json_schema(schema, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(_clean(str(err))) from err


def _clean(message: str) -> str:
    """xgrammar's error message as one line, without its log prefix and echoed input."""
    message = message.strip().split(_ECHOED_INPUT, 1)[0]
    message = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", message))
    return " ".join(message.split())
