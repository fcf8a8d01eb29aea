"""Model loading says what it is doing: every stage before the weights is logged, and the weights'
progress bar has a total (tensors), for safetensors folders and GGUF files alike."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.loader import load_model, load_model_config

from tiny_checkpoints import write_tiny_checkpoint


def _load(path: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Load `path` on the CPU; the loader's log messages, in order."""
    with caplog.at_level(logging.INFO, logger="replaylm.model_loader"):
        config = load_model_config(path)
        load_model(path, config, "auto", torch.float32, torch.device("cpu"))
    return [r.getMessage() for r in caplog.records if r.name.startswith("replaylm.model_loader")]


def _bar_total(stderr: str) -> int:
    """The total of the weights' progress bar, from its final state `N/N`."""
    done = re.findall(r"Loading weights: 100%.*?(\d+)/(\d+)", stderr)
    assert done, stderr[-2000:]
    count, total = map(int, done[-1])
    assert count == total
    return total


def _assert_stages(messages: list[str], first: str, arch: str, layers: int, fmt: str) -> int:
    """The stages in order; returns the tensor count the loading line names."""
    assert messages[0].startswith(first), messages
    assert re.fullmatch(
        rf"building {arch} \({layers} layers\) on cpu in torch.float32", messages[1]
    )
    loading = re.fullmatch(rf"loading (\d+) {fmt} tensors from .+", messages[2])
    assert loading, messages
    assert messages[3].startswith(f"loaded {arch} ({fmt}")
    return int(loading.group(1))


def test_safetensors_stages_and_bar_total(tmp_path, caplog, capsys):
    model = write_tiny_checkpoint("qwen2", tmp_path)
    messages = _load(str(tmp_path), caplog)
    count = _assert_stages(
        messages, "reading the model config of", "Qwen2ForCausalLM", 2, "safetensors"
    )
    assert count == len(model.state_dict()) == _bar_total(capsys.readouterr().err)


def test_gguf_stages_and_bar_total(caplog, capsys):
    path = resolve_model_path("smollm2-135m-instruct")
    messages = _load(path, caplog)
    count = _assert_stages(messages, "reading the GGUF metadata of", "LlamaForCausalLM", 30, "gguf")
    # SmolLM2 ties its embeddings: 30 layers x 9 tensors, the embedding and the final norm
    assert count == 30 * 9 + 2 == _bar_total(capsys.readouterr().err)
