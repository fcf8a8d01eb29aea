"""Structured output through xgrammar: JSON schemas, regexes, EBNF grammars and structural tags.

The tokenizer manager compiles each constrained request's grammar (`compiler`), against the
model's vocabulary as xgrammar describes it (`vocabulary`), and sends it serialized; the scheduler
process loads it (`loader`) into a matcher per request (`grammar`) and masks the logits of
constrained rows to the tokens their grammars allow (`bitmask`). Both sides keep the grammars of
the constraints used last (`cache`): a schema seen recently is neither serialized, sent nor loaded
again. Importing these modules (but `cache` and `loader`) imports xgrammar, so callers import them
where structured output is first needed, not at start-up.
"""
