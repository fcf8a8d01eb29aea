"""One request's place in its grammar (scheduler side)."""

from __future__ import annotations

from collections.abc import Collection

import xgrammar as xgr


class RequestGrammar:
    """An xgrammar matcher over a request's compiled grammar, fed the request's output tokens in
    order. `fed`: how many output tokens it has been given; `rejected`: the first token the
    grammar did not allow (None while every one was), after which nothing more is fed."""

    def __init__(self, matcher: xgr.GrammarMatcher, fed: int = 0, rejected: int | None = None):
        self.matcher = matcher
        self.fed = fed
        self.rejected = rejected

    @classmethod
    def start(
        cls, compiled: xgr.CompiledGrammar, stop_token_ids: Collection[int]
    ) -> RequestGrammar:
        """At the grammar's start. `stop_token_ids` (the model's EOS ids) end a complete output;
        empty: the tokenizer's EOS."""
        stops = sorted(stop_token_ids) or None
        return cls(xgr.GrammarMatcher(compiled, override_stop_tokens=stops))

    def fork(self) -> RequestGrammar:
        """An independent copy at the same place (a choice forked from a shared prefix)."""
        return RequestGrammar(self.matcher.fork(), self.fed, self.rejected)

    def feed(self, index: int, token: int) -> None:
        """Give the matcher output token number `index`, unless it has had it already: the
        overlap schedule feeds a step's tokens before the step is applied."""
        if index < self.fed:
            return
        if index != self.fed:
            raise ValueError(f"output token {index} fed before token {self.fed}")
        self.fed += 1
        if self.rejected is None and not self.matcher.accept_token(token):
            self.rejected = token

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the output is over."""
        return self.matcher.is_terminated()

    @property
    def done(self) -> bool:
        """Nothing more to constrain: terminated, or a token was rejected."""
        return self.rejected is not None or self.terminated
