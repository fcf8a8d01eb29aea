"""benchmark/tuning/bench_decode_chain.py's choices and summary on the CPU (timing needs a CUDA
GPU)."""

from __future__ import annotations

import pytest

from script_import import import_script


@pytest.fixture
def bench():
    return import_script("benchmark/tuning/bench_decode_chain.py")


def test_attention_choices_mark_the_default_policy_once(bench):
    for bs in (1, 8, 64):
        choices = bench.attention_choices(bs, sms=132)
        starred = [name for name in choices if name.endswith("*")]
        default = bench.num_kv_splits(bs, bench.KV_HEADS, 132)
        assert starred == [f"{default} slices, min {bench.MIN_SPLIT_LEN}*"]
        assert choices[starred[0]] == bench.Choice(default, bench.MIN_SPLIT_LEN)
        # matmuls and fusions at their defaults
        assert all(c.matmuls == {} and not c.separate_silu and not c.skip for c in choices.values())


def test_every_sweep_has_one_default_and_varies_only_its_own_field(bench):
    splits = bench.num_kv_splits(8, bench.KV_HEADS, 132)
    fusion = bench.sweep_choices("fusion", 8, sms=132)
    assert fusion["default"] == bench.Choice(splits)
    assert fusion["SiluAndMul launched alone"] == bench.Choice(splits, separate_silu=True)
    assert fusion["attention merged by its last program"] == bench.Choice(
        splits, separate_merge=False
    )
    assert [c.separate_merge for c in fusion.values()].count(False) == 1
    assert {c.skip for c in fusion.values()} == {
        (),
        ("post_norm",),
        ("post_norm", "input_norm"),
        ("rope",),
        ("attention",),
    }
    assert [c.shared_weights for c in fusion.values()].count(True) == 1
    matmul = bench.sweep_choices("matmul", 8, sms=132)
    assert matmul["default"] == bench.Choice(splits)
    assert all(c.splits == splits and not c.skip for c in matmul.values())
    configs = bench.sweep_choices("attention_config", 8, sms=132)
    default = configs["default"]
    assert default.splits == splits and default.min_split_len == bench.MIN_SPLIT_LEN
    assert default.attention == bench.ATTENTION_CONFIG
    for name, choice in configs.items():  # one launch field each, slices at least one block
        changed = [
            f
            for f in default.attention._fields
            if getattr(choice.attention, f) != getattr(default.attention, f)
        ]
        assert len(changed) == (name != "default") and choice.splits == splits
        assert choice.min_split_len == choice.attention.block_n
    assert set(bench.SWEEP_CELLS) == {"attention", "attention_config", "matmul", "fusion"}


def test_summary_gives_each_cell_its_default_and_fastest_choice(bench):
    cell = {"bs": 1, "ctx": 512}
    rows = [
        {"sweep": "attention", **cell, "choice": "64 slices, min 64", "median_us": 9.0},
        {"sweep": "attention", **cell, "choice": "8 slices, min 64*", "median_us": 8.0},
        {"sweep": "attention", **cell, "choice": "4 slices, min 64", "median_us": 7.5},
        {"sweep": "matmul", **cell, "choice": "default", "median_us": 5.0},
        {"sweep": "matmul", **cell, "choice": "o/down split 4", "median_us": 6.0},
    ]
    assert bench.summary(rows) == [
        {
            "sweep": "attention",
            "bs": 1,
            "ctx": 512,
            "default_us": 8.0,
            "best": "4 slices, min 64",
            "best_us": 7.5,
        },
        {
            "sweep": "matmul",
            "bs": 1,
            "ctx": 512,
            "default_us": 5.0,
            "best": "default",
            "best_us": 5.0,
        },
    ]
