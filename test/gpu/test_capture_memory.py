"""CUDA-graph capture that runs out of GPU memory: a one-line error naming the flags that fix it;
the default prefill shapes stop at 2,048 tokens when the prefill chunk is larger."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_parity import dummy_runner

pytestmark = pytest.mark.gpu

SMOLLM2 = Path(__file__).resolve().parents[2] / "benchmark" / "configs" / "smollm2-135m.json"
PREFILL_ONLY = '{"decode": "disabled", "prefill": "breakable"}'
# allowed above what this process holds: the weights and a small KV cache fit, the graphs do not
HEADROOM = 2 * 2**30


@pytest.fixture
def memory_cap():
    """Cap this process's CUDA allocations at what it holds now plus HEADROOM."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + HEADROOM) / total)
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def test_capture_out_of_memory_names_the_flags(memory_cap):
    # one forward of 262,144 tokens needs about 4 GiB of activations (the MLP's 1.6 GiB at once)
    with pytest.raises(RuntimeError) as err:
        dummy_runner(
            SMOLLM2,
            "cuda",
            "bfloat16",
            cuda_graph_mode=PREFILL_ONLY,
            chunked_prefill_size=262144,
            prefill_cuda_graph_tokens=[262144],
            context_length=4096,
        )
    message = str(err.value)
    assert message.startswith("GPU out of memory capturing the prefill CUDA graph of ")
    assert "--prefill-cuda-graph-max-tokens" in message and "--mem-fraction-static" in message
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)


def test_large_prefill_chunks_capture_the_default_shapes_under_the_cap(memory_cap):
    runner = dummy_runner(
        SMOLLM2,
        "cuda",
        "bfloat16",
        cuda_graph_mode=PREFILL_ONLY,
        chunked_prefill_size=16384,
        context_length=4096,
    )
    prefill = runner.graph_runners["prefill"]
    assert prefill.shapes[-1] == 2048  # larger steps run eagerly
    # the tensors crossing the breaks, kept per bucket, would take about 850 MiB
    assert prefill.capture_bytes < 256 * 2**20
