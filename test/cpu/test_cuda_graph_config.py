"""The CUDA-graph resolver, exhaustively: flags, precedence, legacy flags, defaults, rules,
shapes and every validation error; and launch_server's handling of it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from replaylm import cuda_graph_modes
from replaylm.cuda_graph_modes import (
    MODE_TRAITS,
    MODES,
    PHASES,
    debug_eager_modes,
    mode_cells,
    modes_help,
    modes_serving,
)
from replaylm.layers.attention.registry import BACKENDS_WITH_GRAPH_HOOKS
from replaylm.layers.attention.selection import resolve_phase_backends
from replaylm.model_executor.cuda_graph import config
from replaylm.model_executor.cuda_graph.config import (
    CudaGraphConfigError,
    default_decode_batch_sizes,
    resolve_cuda_graph_config,
)
from replaylm.server_args import ServerArgs

JSON = "--cuda-graph-mode"


def resolve(device: str = "cuda", **kwargs):
    args = ServerArgs(**kwargs)
    backends = resolve_phase_backends(
        args.attention_backend, args.prefill_attention_backend, device
    )
    return resolve_cuda_graph_config(args, device, backends)


def modes(cfg) -> tuple[str, str]:
    return cfg.decode.mode, cfg.prefill.mode


# ---- defaults -------------------------------------------------------------------------------


def test_defaults_on_cuda():
    cfg = resolve()
    assert modes(cfg) == ("full", "breakable")
    assert cfg.decode.source == cfg.prefill.source == "default"
    # --max-running-requests not resolved for a device yet: the default list, up to 512
    assert cfg.decode.shapes == default_decode_batch_sizes(512)
    assert cfg.decode.shapes[:5] == (1, 2, 4, 8, 16) and cfg.decode.shapes[-5:] == (
        256,
        320,
        384,
        448,
        512,
    )
    # a larger cap: graphs cover it, every 128 past 512; a flag stops them lower
    wide = resolve(max_running_requests=1000)
    assert wide.decode.shapes[-5:] == (512, 640, 768, 896, 1000)
    assert resolve(max_running_requests=1024, decode_cuda_graph_max_bs=512).decode.shapes == (
        cfg.decode.shapes
    )
    assert cfg.prefill.shapes[0] == 16 and cfg.prefill.shapes[-1] == 2048  # chunked prefill
    assert not cfg.warnings


def test_breakable_needs_no_attention_graph_hooks():
    cfg = resolve(attention_backend="torch_native")
    assert modes(cfg) == ("disabled", "breakable")  # full decode is ruled out, breakable is not
    assert modes(resolve(attention_backend="torch_native", decode_cuda_graph_mode="breakable")) == (
        "breakable",
        "breakable",
    )


def test_defaults_on_cpu_are_off_and_noted_not_an_error():
    cfg = resolve("cpu")
    assert modes(cfg) == ("disabled", "disabled")
    assert any("off by default on cpu" in n for n in cfg.notes)
    assert not cfg.warnings


# ---- every flag alone -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected", "source"),
    [
        ({"cuda_graph_mode": '{"decode": "breakable"}'}, ("breakable", "breakable"), JSON),
        ({"cuda_graph_mode": '{"prefill": "disabled"}'}, ("full", "disabled"), JSON),
        (
            {"cuda_graph_mode": '{"decode": "disabled", "prefill": "tc_piecewise"}'},
            ("disabled", "tc_piecewise"),
            JSON,
        ),
        (
            {"decode_cuda_graph_mode": "tc_piecewise"},
            ("tc_piecewise", "breakable"),
            "--decode-cuda-graph-mode",
        ),
        (
            {"prefill_cuda_graph_mode": "breakable"},
            ("full", "breakable"),
            "--prefill-cuda-graph-mode",
        ),
        (
            {"decode_disable_cuda_graph": True},
            ("disabled", "breakable"),
            "--decode-disable-cuda-graph",
        ),
        (
            {"prefill_disable_cuda_graph": True},
            ("full", "disabled"),
            "--prefill-disable-cuda-graph",
        ),
    ],
)
def test_each_flag_alone(kwargs, expected, source):
    cfg = resolve(**kwargs)
    assert modes(cfg) == expected
    changed = (
        "decode"
        if "decode" in source or "decode" in kwargs.get("cuda_graph_mode", "")
        else "prefill"
    )
    assert cfg.phase(changed).source == source
    assert not cfg.warnings


@pytest.mark.parametrize(
    ("flag", "kwargs", "expected", "replacement"),
    [
        (
            "--disable-cuda-graph",
            {"disable_cuda_graph": True},
            ("disabled", "disabled"),
            "--cuda-graph-mode",
        ),
        (
            "--disable-piecewise-cuda-graph",
            {"disable_piecewise_cuda_graph": True},
            ("full", "disabled"),
            "--prefill-disable-cuda-graph",
        ),
        (
            "--enable-breakable-cuda-graph",
            {"enable_breakable_cuda_graph": True},
            ("full", "breakable"),
            "--prefill-cuda-graph-mode breakable",
        ),
    ],
)
def test_each_legacy_flag_works_with_a_deprecation_warning(flag, kwargs, expected, replacement):
    cfg = resolve(**kwargs)
    assert modes(cfg) == expected
    assert len(cfg.warnings) == 1
    assert cfg.warnings[0].startswith(f"{flag} is deprecated; use ")
    assert replacement in cfg.warnings[0]


# ---- precedence -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "winner", "loser", "phase", "mode"),
    [
        (
            {"cuda_graph_mode": '{"decode": "breakable"}', "decode_cuda_graph_mode": "full"},
            JSON,
            "--decode-cuda-graph-mode",
            "decode",
            "breakable",
        ),
        (
            {"cuda_graph_mode": '{"decode": "full"}', "decode_disable_cuda_graph": True},
            JSON,
            "--decode-disable-cuda-graph",
            "decode",
            "full",
        ),
        (
            {"cuda_graph_mode": '{"prefill": "breakable"}', "prefill_disable_cuda_graph": True},
            JSON,
            "--prefill-disable-cuda-graph",
            "prefill",
            "breakable",
        ),
        (
            {"cuda_graph_mode": '{"decode": "full"}', "disable_cuda_graph": True},
            JSON,
            "--disable-cuda-graph",
            "decode",
            "full",
        ),
        (
            {"cuda_graph_mode": '{"prefill": "disabled"}', "enable_breakable_cuda_graph": True},
            JSON,
            "--enable-breakable-cuda-graph",
            "prefill",
            "disabled",
        ),
        (
            {"prefill_cuda_graph_mode": "tc_piecewise", "enable_breakable_cuda_graph": True},
            "--prefill-cuda-graph-mode",
            "--enable-breakable-cuda-graph",
            "prefill",
            "tc_piecewise",
        ),
        (
            {"prefill_cuda_graph_mode": "breakable", "disable_piecewise_cuda_graph": True},
            "--prefill-cuda-graph-mode",
            "--disable-piecewise-cuda-graph",
            "prefill",
            "breakable",
        ),
        (
            {"decode_cuda_graph_mode": "full", "disable_cuda_graph": True},
            "--decode-cuda-graph-mode",
            "--disable-cuda-graph",
            "decode",
            "full",
        ),
        (
            {"prefill_disable_cuda_graph": True, "enable_breakable_cuda_graph": True},
            "--prefill-disable-cuda-graph",
            "--enable-breakable-cuda-graph",
            "prefill",
            "disabled",
        ),
    ],
)
def test_higher_flag_wins_and_the_override_is_warned(kwargs, winner, loser, phase, mode):
    cfg = resolve(**kwargs)
    assert cfg.phase(phase).mode == mode and cfg.phase(phase).source == winner
    overrides = [w for w in cfg.warnings if "overriding" in w]
    assert len(overrides) == 1 and winner in overrides[0] and loser in overrides[0]


def test_agreeing_flags_are_not_warned_as_overrides():
    cfg = resolve(cuda_graph_mode='{"decode": "full"}', decode_cuda_graph_mode="full")
    assert cfg.decode.mode == "full" and not cfg.warnings


@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        (
            {"decode_cuda_graph_mode": "full", "decode_disable_cuda_graph": True},
            ("--decode-cuda-graph-mode", "--decode-disable-cuda-graph"),
        ),
        (
            {"prefill_cuda_graph_mode": "breakable", "prefill_disable_cuda_graph": True},
            ("--prefill-cuda-graph-mode", "--prefill-disable-cuda-graph"),
        ),
        (
            {"disable_piecewise_cuda_graph": True, "enable_breakable_cuda_graph": True},
            ("--disable-piecewise-cuda-graph", "--enable-breakable-cuda-graph"),
        ),
        (
            {"disable_cuda_graph": True, "enable_breakable_cuda_graph": True},
            ("--disable-cuda-graph", "--enable-breakable-cuda-graph"),
        ),
    ],
)
def test_contradicting_flags_of_one_level_are_an_error(kwargs, flags):
    with pytest.raises(CudaGraphConfigError) as err:
        resolve(**kwargs)
    assert all(f in str(err.value) for f in flags) and "\n" not in str(err.value)


# ---- compatibility rules ----------------------------------------------------------------------


def test_rule_turns_off_a_defaulted_phase_with_its_name_and_reason():
    cfg = resolve(attention_backend="torch_native")
    assert cfg.decode.mode == "disabled"
    assert cfg.decode.source == "rule needs-attention-graph-hooks"
    assert any("needs-attention-graph-hooks" in n and "torch_native" in n for n in cfg.notes)


def test_the_hooks_rule_reads_the_decode_phase_backend():
    """`full` captures decode's attention: the prefill backend does not matter to it."""
    assert modes(resolve(attention_backend="flashinfer")) == ("full", "breakable")
    assert modes(resolve(attention_backend="triton", prefill_attention_backend="torch_native")) == (
        "full",
        "breakable",
    )
    cfg = resolve(attention_backend="torch_native", prefill_attention_backend="flashinfer")
    assert modes(cfg) == ("disabled", "breakable")
    assert any("--attention-backend is torch_native" in n for n in cfg.notes)


def test_rule_on_an_explicit_phase_is_an_error():
    with pytest.raises(CudaGraphConfigError, match="needs-attention-graph-hooks"):
        resolve(attention_backend="torch_native", decode_cuda_graph_mode="full")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decode_cuda_graph_mode": "full"},
        {"cuda_graph_mode": '{"prefill": "breakable"}'},
        {"enable_breakable_cuda_graph": True},
    ],
)
def test_explicit_graph_mode_on_cpu_is_a_clear_error(kwargs):
    with pytest.raises(CudaGraphConfigError, match="graphs-need-cuda.*cpu"):
        resolve("cpu", **kwargs)


def test_debug_switch_lets_the_eager_graph_path_run_on_cpu_but_not_full():
    both = '{"decode": "tc_piecewise", "prefill": "breakable"}'
    assert modes(resolve("cpu", debug_cuda_graph=True, cuda_graph_mode=both)) == (
        "tc_piecewise",
        "breakable",
    )
    assert modes(resolve("cpu", debug_cuda_graph=True)) == ("disabled", "disabled")  # defaults
    with pytest.raises(CudaGraphConfigError, match="graphs-need-cuda.*--debug-cuda-graph"):
        resolve("cpu", debug_cuda_graph=True, decode_cuda_graph_mode="full")


def test_explicitly_disabling_on_cpu_is_fine():
    assert modes(resolve("cpu", disable_cuda_graph=True)) == ("disabled", "disabled")


# ---- the mode traits table drives the rules ---------------------------------------------------


def test_the_flags_help_comes_from_the_traits_table():
    assert modes_help("prefill") == (
        "breakable (a chain of graphs with attention run eagerly between them), tc_piecewise "
        "(torch.compile pieces split at attention, each captured), disabled (eager)"
    )
    assert modes_help().startswith(
        "full (decode/verify/draft only: the whole step in one graph), breakable"
    )
    flags = {f.name: f.metadata["help"] for f in dataclasses.fields(ServerArgs)}
    assert modes_help("decode") in flags["decode_cuda_graph_mode"]
    assert modes_help("prefill") in flags["prefill_cuda_graph_mode"]
    assert modes_help() in flags["cuda_graph_mode"]


def test_the_traits_table_lists_every_graph_mode():
    assert (*MODE_TRAITS, "disabled") == MODES
    assert modes_serving("decode") == ("full", "breakable", "tc_piecewise")
    assert modes_serving("prefill") == ("breakable", "tc_piecewise")
    assert debug_eager_modes() == ("breakable", "tc_piecewise")
    # every mode once, in each phase it serves (the GPU tests' cells)
    assert mode_cells() == [
        ("full", "breakable"),
        ("breakable", "breakable"),
        ("tc_piecewise", "tc_piecewise"),
    ]
    assert {
        "triton",
        "flashinfer",
    } == BACKENDS_WITH_GRAPH_HOOKS  # from the attention registry's table


def _with_traits(monkeypatch, mode: str, **changes) -> None:
    traits = dict(MODE_TRAITS)
    traits[mode] = dataclasses.replace(MODE_TRAITS[mode], **changes)
    monkeypatch.setattr(config, "MODE_TRAITS", traits)
    monkeypatch.setattr(cuda_graph_modes, "MODE_TRAITS", traits)


def test_the_phases_a_mode_serves_come_from_its_row(monkeypatch):
    with pytest.raises(CudaGraphConfigError) as err:
        resolve(prefill_cuda_graph_mode="full")
    assert str(err.value) == (
        "--prefill-cuda-graph-mode: prefill mode 'full' is not supported yet; use 'breakable' "
        "or 'tc_piecewise' (or 'disabled')"
    )
    _with_traits(monkeypatch, "tc_piecewise", phases=("decode",))
    with pytest.raises(CudaGraphConfigError, match="use 'breakable' \\(or 'disabled'\\)$"):
        resolve(prefill_cuda_graph_mode="full")
    with pytest.raises(CudaGraphConfigError, match="prefill mode 'tc_piecewise' is not supported"):
        resolve(prefill_cuda_graph_mode="tc_piecewise")
    _with_traits(monkeypatch, "full", phases=PHASES)
    assert resolve(prefill_cuda_graph_mode="full").prefill.mode == "full"


def test_the_modes_that_run_eagerly_under_the_debug_switch_come_from_the_table(monkeypatch):
    both = '{"decode": "breakable", "prefill": "tc_piecewise"}'
    assert modes(resolve("cpu", debug_cuda_graph=True, cuda_graph_mode=both)) == (
        "breakable",
        "tc_piecewise",
    )
    _with_traits(monkeypatch, "tc_piecewise", debug_eager=False)
    with pytest.raises(CudaGraphConfigError) as err:
        resolve("cpu", debug_cuda_graph=True, cuda_graph_mode=both)
    message = str(err.value)
    assert "rule graphs-need-cuda" in message and "prefill mode 'tc_piecewise'" in message
    assert "only --debug-cuda-graph runs breakable, eagerly, on any device" in message


def test_the_attention_hooks_a_mode_needs_come_from_its_row(monkeypatch):
    assert resolve(attention_backend="torch_native").prefill.mode == "breakable"
    _with_traits(monkeypatch, "breakable", needs_attention_graph_hooks=True)
    cfg = resolve(attention_backend="torch_native")
    assert modes(cfg) == ("disabled", "disabled")
    assert cfg.prefill.source == "rule needs-attention-graph-hooks"
    assert any("a breakable graph captures attention" in n for n in cfg.notes)
    assert resolve(attention_backend="triton").prefill.mode == "breakable"


# ---- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "flag", "fragment"),
    [
        ({"cuda_graph_mode": '{"decode": "full"'}, JSON, "malformed JSON"),
        ({"cuda_graph_mode": '["full"]'}, JSON, "expected a JSON object"),
        (
            {"cuda_graph_mode": '{"mixed": "full"}'},
            JSON,
            "unknown phase 'mixed'; valid phases: decode, prefill, verify, draft",
        ),
        (
            {"cuda_graph_mode": '{"decode": "fast"}'},
            JSON,
            "unknown mode 'fast'; valid modes: full, breakable, tc_piecewise, disabled",
        ),
        ({"cuda_graph_mode": '{"decode": 1}'}, JSON, "unknown mode 1"),
        ({"decode_cuda_graph_mode": "piecewise"}, "--decode-cuda-graph-mode", "unknown mode"),
        ({"prefill_cuda_graph_mode": "eager"}, "--prefill-cuda-graph-mode", "unknown mode"),
        ({"cuda_graph_mode": '{"prefill": "full"}'}, JSON, "use 'breakable' or 'tc_piecewise'"),
        ({"prefill_cuda_graph_mode": "full"}, "--prefill-cuda-graph-mode", "not supported yet"),
        ({"decode_cuda_graph_bs": []}, "--decode-cuda-graph-bs", "one or more positive integers"),
        ({"decode_cuda_graph_bs": [4, 0]}, "--decode-cuda-graph-bs", "positive integers"),
        ({"decode_cuda_graph_max_bs": 0}, "--decode-cuda-graph-max-bs", "positive integer"),
        ({"prefill_cuda_graph_tokens": [-8]}, "--prefill-cuda-graph-tokens", "positive integers"),
        (
            {"prefill_cuda_graph_max_tokens": -1},
            "--prefill-cuda-graph-max-tokens",
            "positive integer",
        ),
        (
            {"decode_cuda_graph_bs": [512], "max_running_requests": 64},
            "--decode-cuda-graph-bs",
            "nothing to capture",
        ),
    ],
)
def test_validation_errors_name_the_flag(kwargs, flag, fragment):
    with pytest.raises(CudaGraphConfigError) as err:
        resolve(**kwargs)
    message = str(err.value)
    assert message.startswith(flag) and fragment in message and "\n" not in message


# ---- shapes -----------------------------------------------------------------------------------


def test_default_batch_sizes_are_clipped_to_max_running_requests():
    assert resolve(max_running_requests=20).decode.shapes == (1, 2, 4, 8, 16, 20)
    assert resolve(decode_cuda_graph_max_bs=32).decode.shapes == (1, 2, 4, 8, 16, 24, 32)


def test_explicit_batch_sizes_sorted_deduplicated_and_clipped_with_warnings():
    cfg = resolve(
        decode_cuda_graph_bs=[8, 1, 8, 3, 300], decode_cuda_graph_max_bs=4, max_running_requests=256
    )
    assert cfg.decode.shapes == (1, 3, 8)
    assert any("dropped [300]" in w for w in cfg.warnings)
    assert any(
        "--decode-cuda-graph-bs overrides --decode-cuda-graph-max-bs" in w for w in cfg.warnings
    )


def test_prefill_token_buckets_default_up_to_the_chunked_prefill_size():
    cfg = resolve(prefill_cuda_graph_mode="breakable", chunked_prefill_size=1000)
    assert cfg.prefill.shapes == (16, 32, 64, 128, 256, 512, 768, 1000)
    cfg = resolve(prefill_cuda_graph_mode="breakable", prefill_cuda_graph_tokens=[100, 50])
    assert cfg.prefill.shapes == (50, 100)


def test_prefill_token_buckets_default_stop_at_2048_under_a_larger_chunk():
    cfg = resolve(prefill_cuda_graph_mode="breakable", chunked_prefill_size=8192)
    assert cfg.prefill.shapes[-1] == 2048  # larger steps run eagerly
    cfg = resolve(
        prefill_cuda_graph_mode="breakable",
        chunked_prefill_size=8192,
        prefill_cuda_graph_max_tokens=4096,
    )
    assert cfg.prefill.shapes[-2:] == (3840, 4096)
    cfg = resolve(
        prefill_cuda_graph_mode="breakable",
        chunked_prefill_size=1000,
        prefill_cuda_graph_max_tokens=4096,
    )
    assert cfg.prefill.shapes[-1] == 1000  # never above the chunk


def test_shapes_are_validated_even_for_a_disabled_phase():
    with pytest.raises(CudaGraphConfigError, match="--decode-cuda-graph-bs"):
        resolve("cpu", decode_cuda_graph_bs=[0])


# ---- launch_server --------------------------------------------------------------------------


def _launch(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "replaylm.launch_server", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_launch_server_bad_mode_exits_2_with_one_line_and_no_traceback():
    proc = _launch("--cuda-graph-mode", '{"decode": "fast"}')
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --cuda-graph-mode: unknown mode 'fast'; valid modes: full, breakable, "
        "tc_piecewise, disabled"
    ]


@pytest.mark.parametrize(
    "flags", [("--device", "cpu"), ("--device", "cuda", "--attention-backend", "torch_native")]
)
def test_launch_server_deterministic_without_triton_attention_exits_2_before_loading(flags):
    proc = _launch("--deterministic", *flags)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --deterministic needs the triton attention backend (batch-invariant kernels, "
        "CUDA only); torch_native has none"
    ]


def test_launch_server_prints_the_config_for_another_device_without_loading():
    proc = _launch(
        "--print-cuda-graph-config",
        "--device",
        "cuda",
        "--cuda-graph-mode",
        '{"prefill": "breakable"}',
        "--max-running-requests",
        "8",
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["decode"] == {"mode": "full", "source": "default", "shapes": [1, 2, 4, 8]}
    assert printed["prefill"]["mode"] == "breakable"
    assert "loaded" not in proc.stderr  # no model was loaded


@pytest.mark.parametrize("decode", [*modes_serving("decode"), "disabled"])
@pytest.mark.parametrize("prefill", [*modes_serving("prefill"), "disabled"])
def test_every_mode_cell_resolves_on_cuda(decode, prefill):
    cfg = resolve(cuda_graph_mode=json.dumps({"decode": decode, "prefill": prefill}))
    assert modes(cfg) == (decode, prefill) and not cfg.warnings


# ---- the verify phase (speculative decoding) ------------------------------------------------


def test_verify_is_off_without_speculation_and_says_so_when_set():
    cfg = resolve()
    assert cfg.verify.mode == "disabled" and cfg.verify.source == "no speculative decoding"
    assert "verify" not in cfg.summary()
    cfg = resolve(cuda_graph_mode=json.dumps({"verify": "breakable"}))
    assert cfg.verify.mode == "disabled"
    assert any("only speculative decoding runs" in w for w in cfg.warnings)


def test_verify_follows_decode():
    cfg = resolve(speculative_algorithm="ngram")
    assert cfg.verify.mode == "full" and cfg.verify.source == "default"
    # row counts spaced as decode batch sizes, up to the default 32 requests x (3 drafts + 1)
    assert cfg.verify.shapes == default_decode_batch_sizes(32 * 4)
    cfg = resolve(
        speculative_algorithm="ngram",
        speculative_num_steps=5,
        speculative_max_bs=16,
        cuda_graph_mode=json.dumps({"decode": "tc_piecewise", "prefill": "breakable"}),
    )
    assert cfg.verify.mode == "tc_piecewise"
    assert cfg.verify.shapes == default_decode_batch_sizes(96)  # 16 requests x (5 + 1) rows
    assert json.loads(cfg.summary())["verify"] == "tc_piecewise"
    cfg = resolve(speculative_algorithm="ngram", decode_disable_cuda_graph=True)
    assert cfg.verify.mode == "disabled"
    cfg = resolve("cpu", speculative_algorithm="ngram")
    assert cfg.verify.mode == "disabled"


def test_verify_takes_any_mode_and_its_own_flags():
    cfg = resolve(
        speculative_algorithm="ngram",
        verify_cuda_graph_mode="full",
        cuda_graph_mode=json.dumps({"decode": "breakable", "prefill": "breakable"}),
    )
    assert (cfg.verify.mode, cfg.verify.source) == ("full", "--verify-cuda-graph-mode")
    cfg = resolve(speculative_algorithm="ngram", verify_disable_cuda_graph=True)
    assert cfg.verify.mode == "disabled" and cfg.verify.source == "--verify-disable-cuda-graph"


def test_draft_follows_decode_for_a_draft_model_or_head_only():
    cfg = resolve(speculative_algorithm="ngram")
    assert (
        cfg.draft.mode == "disabled" and cfg.draft.source == "no draft-model or EAGLE speculation"
    )
    for algorithm in ("draft_model", "eagle", "eagle3"):
        cfg = resolve(speculative_algorithm=algorithm, speculative_draft_model_path="d")
        assert (cfg.draft.mode, cfg.draft.source) == ("full", "default")
        assert cfg.draft.shapes == cfg.decode.shapes
    cfg = resolve(
        speculative_algorithm="draft_model",
        speculative_draft_model_path="d",
        cuda_graph_mode=json.dumps({"decode": "full", "draft": "breakable"}),
    )
    assert cfg.draft.mode == "breakable" and json.loads(cfg.summary())["draft"] == "breakable"
