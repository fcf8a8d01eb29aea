"""Clear errors for unusable model paths and checkpoints."""

from __future__ import annotations

import json

import pytest

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.server_args import ServerArgs

from tiny_checkpoints import write_tiny_checkpoint


def _runner(path, **kw) -> ModelRunner:
    return load_model_runner(
        resolve_engine_config(
            ServerArgs(model_path=str(path), device="cpu", max_total_tokens=256, **kw)
        )
    )


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _runner(tmp_path / "nope")


def test_unknown_architecture_is_named_with_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        _runner(tmp_path, load_format="dummy")
    assert "LlamaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)


def test_corrupt_safetensors_header_names_the_file(tmp_path):
    write_tiny_checkpoint("llama_tied", tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\xff" * 8 + b"not a json header" + path.read_bytes()[64:])
    with pytest.raises(ValueError, match="model.safetensors"):
        _runner(tmp_path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"shape mismatch for 'model\.layers\.0\.mlp\.\w+_proj"):
        _runner(tmp_path)


def test_folder_without_weights(tmp_path):
    write_tiny_checkpoint("qwen3", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        _runner(tmp_path)


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        _runner(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("max_total_tokens", 0, "--max-total-tokens"),
        ("mem_fraction_static", 1.5, "--mem-fraction-static"),
        ("dtype", "int8", "--dtype"),
        ("load_format", "pickle", "--load-format"),
    ],
)
def test_server_args_validation_names_the_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**{field: value}).validate()


def test_deterministic_rejects_native_tc_piecewise_kernels():
    args = ServerArgs(deterministic=True, tc_piecewise_kernels="native")
    with pytest.raises(ValueError, match="--deterministic needs --tc-piecewise-kernels fused"):
        args.validate()
    ServerArgs(deterministic=True).validate()  # the default kernels are fine
