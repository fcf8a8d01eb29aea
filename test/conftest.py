"""Without a CUDA GPU, Triton kernels can only run in Triton's interpreter (on CPU tensors).
The switch is read when a kernel is defined, so it is set here, before any test module imports
one."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
