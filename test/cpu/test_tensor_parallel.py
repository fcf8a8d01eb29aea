"""Tensor parallelism on the CPU (gloo ranks on loopback): the logits of every tensor-parallel
size equal one rank's, for each loader (safetensors, dummy, GGUF) and model family, and sizes
that do not divide the model are one-line errors naming both numbers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from replaylm.distributed.launch import run_on_ranks
from replaylm.distributed.parallel_state import init_tensor_parallel, shows_progress
from replaylm.distributed.peer_all_reduce import all_reduce_for_rank_zero, choose_all_reduce
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.model_loader.builtin_models import DEFAULT_MODEL
from replaylm.runtime.scheduler import Scheduler
from replaylm.server_args import ServerArgs

from model_parity import scripted_logits
from tiny_checkpoints import write_tiny_checkpoint
from tp_ranks import cpu_args, run_ranks, runner_logits, write_dummy_config


def _assert_logits_match(args: ServerArgs, tp_size: int) -> None:
    ref = runner_logits(args, rank=0)
    ours = run_ranks(runner_logits, _with_tp(args, tp_size))
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == b.shape, step
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")


def _with_tp(args: ServerArgs, tp_size: int) -> ServerArgs:
    return dataclasses.replace(args, tp_size=tp_size)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_safetensors_logits_match_one_rank(tmp_path: Path, kind: str) -> None:
    """llama3: untied head; qwen2: QKV biases; qwen3: q/k norm, one KV head replicated."""
    write_tiny_checkpoint(kind, tmp_path)
    _assert_logits_match(cpu_args(str(tmp_path)), tp_size=2)


def test_dummy_logits_match_one_rank_on_three_ranks(tmp_path: Path) -> None:
    config = write_dummy_config(tmp_path)
    _assert_logits_match(cpu_args(str(config), load_format="dummy"), tp_size=3)


def test_gguf_builtin_logits_match_one_rank_on_three_ranks() -> None:
    """SmolLM2-135M: 9 heads, 3 KV heads, so 3 ranks (and not 2)."""
    _assert_logits_match(cpu_args(DEFAULT_MODEL, max_total_tokens=256), tp_size=3)


@pytest.mark.parametrize(
    ("changes", "tp_size", "message"),
    [
        ({}, 5, "--tp-size 5 does not divide the model's 12 attention heads"),
        ({}, 4, "--tp-size 4 does not divide the model's 6 KV heads"),
        (
            {"num_key_value_heads": 1, "intermediate_size": 200},
            3,
            "--tp-size 3 does not divide the model's 200 intermediate (MLP) columns",
        ),
        (
            {"num_key_value_heads": 4},
            6,
            "--tp-size 6 is not a multiple of the model's 4 KV heads (with fewer KV heads "
            "than ranks, each is replicated on as many ranks)",
        ),
    ],
)
def test_sizes_that_do_not_divide_are_one_line_errors(
    tmp_path: Path, changes: dict[str, int], tp_size: int, message: str
) -> None:
    """Checked before the rank joins its group, so every rank fails alike and at once."""
    config = write_dummy_config(tmp_path, **changes)
    args = _with_tp(cpu_args(str(config), load_format="dummy"), tp_size)
    with pytest.raises(ValueError) as err:
        load_model_runner(resolve_engine_config(args), tp_rank=0)
    assert str(err.value) == message


def _rank_shows_progress(args: ServerArgs, rank: int) -> bool:
    assert args.dist_init_addr is not None
    init_tensor_parallel(rank, args.tp_size, args.dist_init_addr, torch.device("cpu"))
    return shows_progress()


def test_only_rank_0_draws_progress_bars() -> None:
    """The ranks load and capture in step: the others' bars would repeat rank 0's."""
    assert shows_progress()  # no group: the one process draws them
    args = _with_tp(cpu_args(DEFAULT_MODEL), 3)
    assert run_on_ranks(_rank_shows_progress, args, timeout_s=120) == [True, False, False]


def test_one_shot_all_reduce_is_an_error_off_cuda(tmp_path: Path) -> None:
    """`--tp-all-reduce one-shot` needs GPUs' peer memory: on the CPU the start fails at once,
    naming the flag, before any rank joins a group."""
    config = write_dummy_config(tmp_path)
    args = _with_tp(cpu_args(str(config), load_format="dummy", tp_all_reduce="one-shot"), 2)
    with pytest.raises(ValueError, match=r"^--tp-all-reduce one-shot needs CUDA GPUs"):
        load_model_runner(resolve_engine_config(args), tp_rank=0)


def test_auto_all_reduce_takes_one_shot_only_where_every_gpu_reaches_every_other() -> None:
    """auto: one-shot over CUDA GPUs of one machine with peer access between every pair; NCCL
    on the CPU, across machines, or where a pair lacks access (the reason says which)."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def every(a: int, b: int) -> bool:
        return True

    assert choose_all_reduce("auto", cuda, 4, 4, every) == (
        "one-shot",
        "auto: 4 GPUs of one machine with peer access",
    )
    assert choose_all_reduce("auto", cpu, 2, 2, every)[0] == "nccl"
    assert choose_all_reduce("auto", cuda, 8, 4, every) == (
        "nccl",
        "auto: the ranks span several machines",
    )
    asked: list[tuple[int, int]] = []

    def one_pair_blocked(a: int, b: int) -> bool:
        asked.append((a, b))
        return (a, b) != (2, 1)

    choice, why = choose_all_reduce("auto", cuda, 3, 3, one_pair_blocked)
    assert (choice, "cannot reach" in why) == ("nccl", True) and (2, 1) in asked
    assert choose_all_reduce("nccl", cuda, 4, 4, every) == ("nccl", "as asked")
    assert choose_all_reduce("one-shot", cpu, 2, 2, every) == ("one-shot", "as asked")


def test_a_process_meets_peers_over_peer_memory_once() -> None:
    """An Engine's process is rank 0 of each group it starts; torch's symmetric memory meets
    peers once per process, so after one such group auto falls back to NCCL for every rank
    (saying why) and one-shot is a start-up error naming the field, never a hang."""
    for choice in ("auto", "nccl", "one-shot"):
        assert all_reduce_for_rank_zero(choice, met_before=False) == (choice, None)
    choice, why = all_reduce_for_rank_zero("auto", met_before=True)
    assert choice == "nccl" and why is not None and "once per process" in why
    assert all_reduce_for_rank_zero("nccl", met_before=True) == ("nccl", None)
    with pytest.raises(ValueError, match=r"^tp_all_reduce: 'one-shot' can serve one"):
        all_reduce_for_rank_zero("one-shot", met_before=True)


def test_one_rank_builds_no_parallel_layers(tmp_path: Path) -> None:
    """--tp-size 1 keeps the plain layers: no collective anywhere in its forward."""
    write_tiny_checkpoint("llama3", tmp_path)
    runner = load_model_runner(resolve_engine_config(cpu_args(str(tmp_path))))
    names = {type(m).__name__ for m in runner.model.modules()}
    assert not {n for n in names if "Parallel" in n or n == "RankZeroSampler"}
    sched = Scheduler(runner, frozenset(), None, 2048, None)
    assert type(sched.sampler).__name__ == "Sampler"
    assert torch.isfinite(scripted_logits(runner, (3,), 1, first_decode_id=7)[0]).all()
