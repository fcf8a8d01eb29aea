"""benchmark/common.py, the module the benchmarks share (and doc_tables.py, the page's tables,
render_docs.py's own): every script imports on the CPU as run from its folder, none imports
another script, and results carry their environment."""

from __future__ import annotations

import ast
import json
import re
import time

import pytest
import torch

from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.loader import load_model_config

from script_import import REPO, import_script

MODULES = ("common.py", "doc_tables.py")  # imported by scripts, no scripts themselves
SCRIPTS = sorted(
    path.relative_to(REPO).as_posix()
    for path in (REPO / "benchmark").rglob("*.py")
    if path.name not in MODULES
)


def test_the_scripts_are_the_benchmarks_and_the_tuning_tools():
    assert "benchmark/bench_one_batch.py" in SCRIPTS
    assert "benchmark/tuning/bench_decode_chain.py" in SCRIPTS
    assert all(s.count("/") == 1 or s.startswith("benchmark/tuning/") for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_imports_no_other_script_and_loads(script):
    names = {(REPO / s).stem for s in SCRIPTS}
    tree = ast.parse((REPO / script).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & names, f"{script} imports another script: use a shared module"
    assert callable(import_script(script).main)


def test_write_json_records_the_environment_beside_the_result(tmp_path):
    common = import_script("benchmark/common.py")
    out = tmp_path / "result.json"
    config = {"model_path": str(REPO / "benchmark" / "configs" / "qwen3-0.6b.json")}
    config |= {"json": str(out), "endpoint": "/v1/completions"}
    common.write_json(out, {"config": config, "summary": [{"name": "x", "ms": 1.5}]})
    doc = json.loads(out.read_text())
    assert doc["summary"] == [{"name": "x", "ms": 1.5}]
    # paths of the machine: under the repository relative to it, else the file name alone
    assert doc["config"] == {
        "model_path": "benchmark/configs/qwen3-0.6b.json",
        "json": "result.json",
        "endpoint": "/v1/completions",
    }
    env = doc["environment"]
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert (env["gpu"] is None) == (not torch.cuda.is_available())
    assert env["commit"] is None or re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", env["commit"])


def test_configs_are_the_models_of_the_docs():
    common = import_script("benchmark/common.py")
    names = sorted(p.stem for p in common.CONFIGS.glob("*.json"))
    assert names == [
        "eagle3-llama-3.1-8b",
        "llama-3.1-70b",
        "llama-3.1-8b",
        "llama-3.2-1b",
        "mixtral-8x7b",
        "qwen3-0.6b",
        "qwen3-30b-a3b",
        "smollm2-135m",
    ]
    assert common.model_config("qwen3-0.6b")["num_hidden_layers"] == 28
    assert common.model_config("llama-3.1-8b")["hidden_size"] == 4096
    # the built-in model's shapes, as its GGUF gives them (speed work on dummy weights)
    small = load_model_config(common.config_path("smollm2-135m").as_posix())
    real = load_model_config(resolve_model_path("smollm2-135m-instruct"))
    shapes = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "head_dim",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rope_theta",
              "max_position_embeddings", "tie_word_embeddings", "eos_token_ids")  # fmt: skip
    assert [getattr(small, f) for f in shapes] == [getattr(real, f) for f in shapes]
    assert small.rms_norm_eps == pytest.approx(real.rms_norm_eps)  # the GGUF's is a float32
    # the draft model of bench_speculative: Llama-3.1-8B's vocabulary, tied embeddings
    draft = load_model_config(common.config_path("llama-3.2-1b").as_posix())
    assert (draft.vocab_size, draft.num_hidden_layers, draft.head_dim) == (128256, 16, 64)
    assert draft.tie_word_embeddings
    # its EAGLE-3 head: the 8B's width and vocabulary, one layer, a 32k draft vocabulary
    head = load_model_config(common.config_path("eagle3-llama-3.1-8b").as_posix())
    assert (head.architecture, head.hidden_size, head.vocab_size, head.num_hidden_layers) == (
        "LlamaForCausalLMEagle3",
        4096,
        128256,
        1,
    )
    assert head.hf_config["draft_vocab_size"] == 32000
    big = common.model_config("llama-3.1-70b")
    assert (big["num_hidden_layers"], big["hidden_size"], big["num_key_value_heads"]) == (
        80,
        8192,
        8,
    )


def test_capture_timers_count_a_nested_part_once():
    """bench_capture's parts never overlap: a kernel load inside a warm-up is the load's time."""
    timers = import_script("benchmark/tuning/bench_capture.py").Timers()
    load = timers.wrap("kernel loads", lambda: time.sleep(0.2))
    warm_up = timers.wrap("warm-up", lambda: (time.sleep(0.01), load()))
    warm_up()  # outside a capture: not timed
    assert not timers.seconds
    timers.phase = "decode"
    warm_up()
    assert timers.seconds["decode", "kernel loads"] >= 0.2
    assert timers.seconds["decode", "warm-up"] < 0.15  # the load's 0.2 s left out
    assert timers.calls["decode", "warm-up"] == timers.calls["decode", "kernel loads"] == 1
