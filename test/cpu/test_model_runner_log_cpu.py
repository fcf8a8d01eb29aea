"""The model runner's set-up log says which kernels run on its device: the layers' Triton route
only where the kernels' own test lets them take it, programmatic dependent launch only on CUDA."""

from __future__ import annotations

import logging

import pytest

from replaylm.layers import kernels
from replaylm.model_executor import runner_setup
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.server_args import ServerArgs

from tiny_checkpoints import write_tiny_checkpoint


def _runner_log(folder, caplog: pytest.LogCaptureFixture) -> str:
    write_tiny_checkpoint("qwen3", folder)
    args = ServerArgs(
        model_path=str(folder), device="cpu", max_total_tokens=256, max_running_requests=4
    )
    with caplog.at_level(logging.INFO, logger=runner_setup.__name__):
        runner_setup.load_model_runner(resolve_engine_config(args))
    return "\n".join(r.getMessage() for r in caplog.records if r.name == runner_setup.__name__)


def test_the_cpu_log_claims_torch_code_and_neither_triton_nor_pdl(tmp_path, caplog):
    log = _runner_log(tmp_path, caplog)
    assert "matmuls and fused ops: torch code on cpu" in log
    assert "attention torch_native, matmul torch" in log  # the ready line
    assert "triton" not in log.lower()
    assert "programmatic dependent launch" not in log


def test_the_log_follows_the_kernels_route_not_the_device(tmp_path, caplog, monkeypatch):
    """With the kernels pointed at the CPU (Triton's interpreter) the layers take the Triton
    route, and the log says so; PDL stays unmentioned off CUDA."""
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    log = _runner_log(tmp_path, caplog)
    assert "--small-batch-matmul auto: the skinny triton kernel for" in log
    assert "matmul auto" in log and "torch code" not in log
    assert "programmatic dependent launch" not in log
