"""Every test under test/gpu needs CUDA: skip them all (visibly) where there is none."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "test/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
