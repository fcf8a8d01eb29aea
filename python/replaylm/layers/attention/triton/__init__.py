"""Triton attention over the paged KV pool: decode (split-K), extend (ragged, prefix + causal) and
the KV store kernels, and the backend that runs them (importing this package imports triton)."""

from replaylm.layers.attention.triton.backend import TritonAttnBackend

__all__ = ["TritonAttnBackend"]
