"""Choosing the attention backend: `auto` per device, GPU-only backends refused on the CPU; the
registry's traits are those of the classes."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from replaylm.layers.attention.base import AttentionBackend, CudaGraphAttentionBackend
from replaylm.layers.attention.registry import (
    ATTENTION_BACKENDS,
    BACKENDS_WITH_GRAPH_HOOKS,
    create_attention_backend,
)
from replaylm.layers.attention.selection import (
    PhaseAttentionBackends,
    resolve_attention_backend,
    resolve_phase_backends,
)
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs

from tiny_checkpoints import write_tiny_checkpoint


def test_auto_is_triton_on_cuda_and_torch_native_elsewhere():
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch_native"
    assert resolve_attention_backend("torch_native", "cuda") == "torch_native"
    assert {"auto", "triton", "torch_native"} <= set(ATTENTION_BACKEND_CHOICES)


def test_triton_on_the_cpu_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--attention-backend triton needs a CUDA device"):
        resolve_attention_backend("triton", "cpu")
    write_tiny_checkpoint("qwen3", tmp_path)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        load_model_runner(
            resolve_engine_config(
                ServerArgs(
                    model_path=str(tmp_path),
                    device="cpu",
                    attention_backend="triton",
                    max_total_tokens=64,
                    max_running_requests=2,
                )
            )
        )


@pytest.mark.parametrize("name", sorted(ATTENTION_BACKENDS))
def test_the_registry_traits_are_the_classes(name):
    """The torch-free table says what each class offers: the hooks of a `full` graph (from which
    the CUDA-graph resolver's list of hooked backends is derived) and batch-invariant kernels."""
    spec = ATTENTION_BACKENDS[name]
    cls = spec.load()
    assert issubclass(cls, AttentionBackend) and cls.name == name
    assert issubclass(cls, CudaGraphAttentionBackend) == spec.graph_hooks
    assert (name in BACKENDS_WITH_GRAPH_HOOKS) == spec.graph_hooks
    assert ("deterministic" in inspect.signature(cls).parameters) == spec.deterministic
    assert ("auto", *ATTENTION_BACKENDS) == ATTENTION_BACKEND_CHOICES


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="flashinfer, torch_native, triton"):
        create_attention_backend("flash_attn")


def test_prefill_backend_defaults_to_the_decode_one_and_is_checked_for_the_device():
    assert resolve_phase_backends("auto", None, "cuda") == PhaseAttentionBackends(
        "triton", "triton"
    )
    both = resolve_phase_backends("flashinfer", "triton", "cuda")
    assert (both.decode, both.prefill) == ("flashinfer", "triton")
    assert both.of_phase("prefill") == ("--prefill-attention-backend", "triton")
    assert both.describe() == "flashinfer (decode), triton (prefill)"
    with pytest.raises(ValueError, match="--prefill-attention-backend flashinfer needs a CUDA"):
        resolve_phase_backends("auto", "flashinfer", "cpu")


def test_a_backend_whose_library_is_missing_names_it():
    """flashinfer's module imports anywhere (the registry test loads its class); the library is
    imported when the backend is made."""
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed here")
    with pytest.raises(ValueError, match="'flashinfer' cannot be imported .*flashinfer"):
        create_attention_backend("flashinfer")
