"""CUDA-graph subsystem: phase runners (what shapes, which buffers) x backends (how to capture)."""
