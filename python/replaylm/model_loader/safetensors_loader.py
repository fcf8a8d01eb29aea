"""Reading HF safetensors checkpoints: one file, several, or a sharded index."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint files of `folder`, from the shard index when there is one."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({os.path.join(folder, name) for name in weight_map.values()})
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names missing shard files: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {folder} (only safetensors checkpoints are supported)"
        )
    return files


def count_safetensors_tensors(files: list[str]) -> int:
    """Number of tensors in the files (reads headers only)."""
    total = 0
    for path in files:
        with _open(path) as f:
            total += len(f.keys())
    return total


def iter_safetensors_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every file; ValueError names a corrupt file."""
    for path in files:
        with _open(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _open(path: str):  # noqa: ANN202 - safetensors' handle type is private
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read safetensors file {path}: {e}") from e
