"""replaylm: a compact LLM inference server built around CUDA-graph capture and replay."""

__version__ = "0.1.0"
