"""Structured output through xgrammar: JSON schemas, regexes, EBNF grammars and structural tags.

The tokenizer manager compiles each constrained request's grammar (`compiler`), against the
model's vocabulary as xgrammar describes it (`vocabulary`), and sends it serialized; the scheduler
process loads it into a matcher per request (`grammar`) and masks the logits of constrained rows
to the tokens their grammars allow (`bitmask`). Importing these modules imports xgrammar, so
callers import them where structured output is first needed, not at start-up.
"""
