"""Speculative decoding: drafters propose tokens, the target model checks them in one verify step.

A `Drafter` proposes up to k tokens per running request; the scheduler's verify step runs the
target over each request's last token and its drafts at once (ForwardMode.TARGET_VERIFY, logits
at every position), keeps the longest run of drafts the target agrees with plus the target's own
next token, and gives back the KV slots of the rest.
"""
