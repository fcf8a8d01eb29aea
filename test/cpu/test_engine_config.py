"""resolve_engine_config: the flags resolved once for the machine (device, running-request cap,
attention backends, CUDA-graph config), and the torch-free GPU probe it asks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replaylm.device.gpu_probe import GpuFacts, probe_gpus
from replaylm.model_executor.cuda_graph.config import (
    CudaGraphConfigError,
    default_decode_batch_sizes,
)
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.server_args import ServerArgs, default_api_server_count

H200 = GpuFacts(1, 141 * 2**30)
SMALL_GPU = GpuFacts(1, 24 * 2**30)


def test_auto_on_a_machine_without_a_gpu_is_the_cpu_eagerly():
    config = resolve_engine_config(ServerArgs(), gpus=None)
    assert probe_gpus() is None  # this machine: no GPU (the probe asks torch, imported here)
    assert config.args.device == "cpu" and config.device_type == "cpu"
    assert config.args.max_running_requests == 256
    assert (config.attention.decode, config.attention.prefill) == ("torch_native", "torch_native")
    assert config.cuda_graphs.summary() == '{"decode": "disabled", "prefill": "disabled"}'
    assert "max running requests: 256 (the default for cpu)" in config.notes


@pytest.mark.parametrize(("gpu", "cap"), [(H200, 1024), (SMALL_GPU, 256)])
def test_auto_with_a_gpu_resolves_for_it(gpu, cap):
    config = resolve_engine_config(ServerArgs(), gpus=gpu)
    assert config.args.device == "cuda" and config.args.max_running_requests == cap
    assert config.attention.describe() == "triton"
    graphs = config.cuda_graphs
    assert (graphs.decode.mode, graphs.prefill.mode) == ("full", "breakable")
    # decode graphs cover the running cap
    assert graphs.decode.shapes == default_decode_batch_sizes(cap)
    assert any(f"a GPU of {gpu.memory_bytes // 2**30} GiB" in note for note in config.notes)


def test_a_given_cap_is_kept_and_cuts_the_decode_shapes():
    config = resolve_engine_config(ServerArgs(max_running_requests=12), gpus=H200)
    assert config.args.max_running_requests == 12
    assert not any("max running requests" in note for note in config.notes)
    assert config.cuda_graphs.decode.shapes == (1, 2, 4, 8, 12)


@pytest.mark.parametrize(
    ("device", "cores", "front_ends"),
    [("cuda", 16, 8), ("cuda", 64, 8), ("cuda", 6, 3), ("cuda", 1, 1), ("cpu", 64, 1)],
)
def test_the_front_ends_default_to_half_the_cores_on_a_gpu(device, cores, front_ends):
    assert default_api_server_count(device, cores) == front_ends


def test_a_given_front_end_count_is_kept_and_a_default_is_logged():
    assert resolve_engine_config(ServerArgs(api_server_count=3), gpus=H200).api_server_count == 3
    config = resolve_engine_config(ServerArgs(device="cpu"))
    assert config.api_server_count == 1
    assert "HTTP front-end processes: 1 (the default for cpu)" in config.notes


def test_a_named_gpu_this_machine_lacks_resolves_for_printing_only():
    config = resolve_engine_config(ServerArgs(device="cuda"), gpus=None)
    assert config.args.device == "cuda" and config.args.max_running_requests is None
    assert config.cuda_graphs.decode.shapes[-1] == 512


def test_the_graph_backends_options_travel_in_the_config():
    args = ServerArgs(
        debug_cuda_graph=True,
        tc_piecewise_compiler="eager",
        compile_cache_dir="compile-cache",
        cuda_graph_mode='{"decode": "tc_piecewise", "prefill": "tc_piecewise"}',
    )
    options = resolve_engine_config(args, gpus=None).cuda_graphs.options
    assert (options.debug, options.compiler, options.kernels) == (True, "eager", "fused")
    assert options.compile_cache_dir == "compile-cache"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"deterministic": True}, "--deterministic needs the triton attention backend"),
        ({"enable_pdl": True}, "--enable-pdl needs a CUDA GPU of compute capability 9.0+"),
        ({"attention_backend": "triton"}, "--attention-backend triton needs a CUDA device"),
    ],
)
def test_combinations_the_cpu_cannot_run_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve_engine_config(ServerArgs(**kwargs), gpus=None)
    assert "\n" not in str(err.value)


def test_a_mode_the_device_cannot_take_fails_by_its_rule():
    with pytest.raises(CudaGraphConfigError, match="rule graphs-need-cuda"):
        resolve_engine_config(ServerArgs(decode_cuda_graph_mode="full"), gpus=None)


def test_the_driver_probe_needs_no_torch():
    """In a process without torch the probe asks the CUDA driver (none here: no GPU)."""
    code = (
        "import sys; from replaylm.device.gpu_probe import probe_gpus; "
        "print(probe_gpus(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False"]
