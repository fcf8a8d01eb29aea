"""The fused MoE kernels' launch configs: table files, the nearest-M lookup, the default without a
table, the committed tables' format, and the tuning tool's pure parts (its search space, its
command line), one config for every batch under --deterministic, and the start-up log line."""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch

from replaylm.layers.moe.block_configs import (
    BATCH_INVARIANT_TOKENS,
    CONFIG_DIR,
    MoeBlockConfig,
    config_file_name,
    config_tokens,
    default_config,
    device_name,
    load_table,
    moe_block_config,
    set_batch_invariant,
    write_table,
)

from model_parity import make_runner
from script_import import import_script
from tiny_checkpoints import write_tiny_checkpoint

SHAPE = {"num_experts": 128, "intermediate": 768, "hidden": 2048}
TABLE = {
    1: MoeBlockConfig(16, 64, 128, 1, num_warps=4, num_stages=4),
    16: MoeBlockConfig(16, 128, 128, 16, num_warps=4, num_stages=3),
    64: MoeBlockConfig(32, 128, 64, 16, num_warps=8, num_stages=4),
}


def test_file_name_and_json_entries():
    name = config_file_name(128, 768, 2048, torch.bfloat16, "NVIDIA_H200")
    assert name == "E=128,N=768,K=2048,device_name=NVIDIA_H200,dtype=bfloat16.json"
    assert device_name(torch.device("cpu")) == "cpu"
    config = TABLE[64]
    assert config.to_json() == {
        "BLOCK_SIZE_M": 32,
        "BLOCK_SIZE_N": 128,
        "BLOCK_SIZE_K": 64,
        "GROUP_SIZE_M": 16,
        "num_warps": 8,
        "num_stages": 4,
    }
    assert MoeBlockConfig.from_json(config.to_json()) == config
    sizes_only = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    assert MoeBlockConfig.from_json(sizes_only) == MoeBlockConfig(16, 32, 64, 1, 4, 3)


@pytest.mark.parametrize(("tokens", "key"), [(1, 1), (8, 1), (10, 16), (40, 16), (41, 64)])
def test_table_lookup_takes_the_nearest_token_count(tmp_path, tokens, key):
    """The entry of the nearest M, the smaller on a tie (40 is 24 from both 16 and 64); the
    source names the file."""
    name = config_file_name(**SHAPE, dtype=torch.bfloat16, device="NVIDIA_H200")
    write_table(tmp_path / name, TABLE)
    assert list(json.loads((tmp_path / name).read_text())) == ["1", "16", "64"]
    config, source = moe_block_config(
        **SHAPE, tokens=tokens, dtype=torch.bfloat16, device="NVIDIA_H200", config_dir=tmp_path
    )
    assert (config, source) == (TABLE[key], f"table {name}")


def test_default_without_a_table(tmp_path):
    """Another GPU, dtype or shape has no table: the default, 16-row blocks up to as many tokens
    as experts and 64-row ones above."""
    write_table(tmp_path / config_file_name(**SHAPE, dtype=torch.bfloat16, device="A"), TABLE)
    for dtype, device in [(torch.bfloat16, "B"), (torch.float16, "A")]:
        config, source = moe_block_config(
            **SHAPE, tokens=8, dtype=dtype, device=device, config_dir=tmp_path
        )
        assert (config, source) == (default_config(8, 128), "default")
    assert default_config(128, 128).block_m == 16
    assert default_config(129, 128).block_m == 64


def test_committed_tables_parse():
    """Each table in the configs folder is named as lookups spell it and has valid entries."""
    for path in CONFIG_DIR.glob("*.json"):
        assert path.name.startswith("E=") and ",device_name=" in path.name
        table = load_table(path)
        assert table and all(isinstance(m, int) and m > 0 for m in table)


def args_of(flags: dict[str, str]) -> list[str]:
    return [word for pair in flags.items() for word in pair]


def test_tuning_tool_search_space_and_command_line(capsys):
    pytest.importorskip("triton", reason="the tuning tool imports the kernels")
    tool = import_script("benchmark/tuning/tune_moe.py")
    decode = tool.search_space(1, 8, 128)
    assert decode and {c.block_m for c in decode} == {16}
    # 256 tokens average 16 rows an expert; the busiest take up to twice that
    assert {c.block_m for c in tool.search_space(256, 8, 128)} == {16, 32}
    prefill = tool.search_space(4096, 8, 128)
    assert {c.block_m for c in prefill} == {16, 32, 64, 128}
    for config in prefill:
        assert tool.shared_memory_bytes(config, 2) <= tool.SHARED_MEMORY
        assert config.num_warps == 4 or config.block_m * config.block_n >= 64 * 64
    assert len(tool.sampled(prefill, 10)) == 10 and tool.sampled(decode, None) == decode
    tall = tool.fixed(prefill, {"block_m": 128, "block_k": 64})
    assert tall and {(c.block_m, c.block_k) for c in tall} == {(128, 64)}
    shape = {"--experts": "8", "--hidden": "64", "--intermediate": "32", "--top-k": "2"}
    args = tool.parse_args(args_of(shape))
    assert (args.dtype, args.tokens[0], args.out_dir) == ("bfloat16", 1, CONFIG_DIR)
    assert tool.parse_args([*args_of(shape), "--fix", "block_m=64"]).fix == {"block_m": 64}
    with pytest.raises(SystemExit):
        tool.parse_args([*args_of(shape), "--fix", "tile=64"])
    assert "not ['tile']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        tool.parse_args(["--help"])
    assert exit_info.value.code == 0 and "--max-configs" in capsys.readouterr().out


def test_deterministic_batches_take_one_config(tmp_path):
    """Under `set_batch_invariant` every token count looks up one entry of the table."""
    name = config_file_name(128, 768, 2048, torch.bfloat16, "gpu")
    write_table(tmp_path / name, TABLE)
    pick = functools.partial(
        moe_block_config, 128, 768, 2048, dtype=torch.bfloat16, device="gpu", config_dir=tmp_path
    )
    assert {pick(tokens=config_tokens(m))[0] for m in (1, 16, 64, 4096)} == set(TABLE.values())
    try:
        set_batch_invariant(True)
        chosen = {pick(tokens=config_tokens(m))[0] for m in (1, 16, 64, 4096)}
    finally:
        set_batch_invariant(False)
    assert chosen == {TABLE[BATCH_INVARIANT_TOKENS]}


def test_the_start_up_log_names_the_experts_kernel(tmp_path, caplog):
    """On the CPU: the torch code, with the layers and experts counted."""
    layers = write_tiny_checkpoint("qwen3_moe", tmp_path).config.num_hidden_layers
    with caplog.at_level(logging.INFO, logger="replaylm.model_executor.runner_setup"):
        make_runner(str(tmp_path), "cpu", "float32")
    line = f"{layers} mixture-of-experts layers of 8 experts (top 2): torch code on cpu"
    assert line in caplog.text
