"""--max-running-requests' default: chosen for the device the model loads on, and what every
process then uses (request table, CUDA-graph shapes, the `n` limit, /get_server_info)."""

from __future__ import annotations

import asyncio

import pytest

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.runtime.errors import RequestError
from replaylm.runtime.io_struct import GenerateRequest
from replaylm.runtime.tokenizer_manager import TokenizerManager
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs, default_max_running_requests

from tiny_checkpoints import write_tiny_checkpoint

GIB = 2**30


@pytest.mark.parametrize(
    ("memory", "cap"),
    [(None, 256), (16 * GIB, 256), (30 * GIB, 512), (48 * GIB, 512), (80 * GIB, 1024)],
)
def test_default_by_gpu_memory(memory, cap):
    assert default_max_running_requests(memory) == cap


def test_the_scheduler_resolves_it_and_the_front_end_follows(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path)
    args = ServerArgs(model_path=str(tmp_path), device="cpu", max_total_tokens=4096)
    assert args.max_running_requests is None
    tm = TokenizerManager(resolve_engine_config(args))
    try:
        assert tm.max_running_requests == 256  # the CPU's default
        assert tm.server_info()["max_running_requests"] == 256
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        request = GenerateRequest([5, 6], params, n=2)

        async def ask() -> int:
            return len([o async for o in tm.generate(request)])

        assert asyncio.run(ask()) == 2  # one output per choice
    finally:
        tm.shutdown()


def test_the_n_limit_is_the_resolved_cap(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path)
    tm = TokenizerManager(
        resolve_engine_config(
            ServerArgs(
                model_path=str(tmp_path),
                device="cpu",
                max_total_tokens=4096,
                max_running_requests=3,
            )
        )
    )
    try:
        request = GenerateRequest([5, 6], SamplingParams(max_new_tokens=1), n=4)
        with pytest.raises(RequestError, match=r"n must be in \[1, 3\]"):
            asyncio.run(anext(tm.generate(request)))
    finally:
        tm.shutdown()
