"""`--deterministic` on SmolLM2 (bfloat16): a request's greedy tokens do not depend on the batch it
runs in, on how its prompt is chunked, or on the CUDA-graph mode.

Without it, cuBLAS picks kernels by the batch's row count and the attention kernels split work by
batch size and chunk, so the same prompt can round differently in another batch (the accuracy
suite's pilot: 77.5% of gsm8k completions identical between two servers computing bit-equal
per batch). Each check here compares token ids exactly, across batches of different sizes.
"""

from __future__ import annotations

import json

import pytest

from replaylm.cuda_graph_modes import DISABLED, mode_cells
from replaylm.entrypoints.engine import Engine

pytestmark = pytest.mark.gpu

PARAMS = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
TOPICS = ["cats", "Rome", "the ocean", "stars", "bread", "rivers", "music", "glass"]


def _engine(**kw) -> Engine:
    args = dict(
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=60000,
        deterministic=True,
        max_running_requests=64,
    )
    return Engine(**{**args, **kw})


EAGER = json.dumps({"decode": "disabled", "prefill": "disabled"})


@pytest.fixture(scope="module")
def eager() -> Engine:
    return _engine(cuda_graph_mode=EAGER)


@pytest.fixture(scope="module")
def prompts(eager) -> list[list[int]]:
    return [
        eager.encode_chat([{"role": "user", "content": f"Write fact {i} about {t}."}])
        for i, t in enumerate(TOPICS * 5)
    ]


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=PARAMS)]


@pytest.fixture(scope="module")
def together(eager, prompts) -> list[list[int]]:
    return _generate(eager, prompts)


def test_a_request_alone_generates_what_it_generates_in_a_batch(eager, prompts, together):
    alone = [_generate(eager, [p])[0] for p in prompts[:6]]
    assert alone == together[:6]
    assert _generate(eager, prompts[:13]) == together[:13]  # a batch of another size


def test_chunked_prefill_generates_what_whole_prefill_generates(prompts, together):
    chunked = _engine(cuda_graph_mode=EAGER, chunked_prefill_size=16, max_prefill_tokens=40)
    assert _generate(chunked, prompts) == together


@pytest.mark.parametrize(("decode", "prefill"), mode_cells())
def test_graph_modes_generate_what_eager_generates(prompts, together, decode, prefill):
    graphed = _engine(
        cuda_graph_mode=json.dumps({"decode": decode, "prefill": prefill}),
        decode_cuda_graph_bs=[1, 2, 4, 8, 16, 32, 64],
    )
    assert _generate(graphed, prompts) == together
    stats = graphed.runner.forward_stats.phases
    assert stats["decode"].graph > 0 and stats["prefill"].graph > 0


@pytest.mark.parametrize(("decode", "prefill"), [*mode_cells(), (DISABLED, DISABLED)])
def test_mixed_steps_generate_what_eager_generates(prompts, together, decode, prefill):
    """`--enable-mixed-chunk`: prompts prefill 64 tokens a step beside the running requests'
    decode tokens (through the decode kernel), in every mode; nothing changes."""
    mixed = _engine(
        cuda_graph_mode=json.dumps({"decode": decode, "prefill": prefill}),
        decode_cuda_graph_bs=[1, 2, 4, 8, 16, 32, 64],
        enable_mixed_chunk=True,
        chunked_prefill_size=64,
    )
    decoding: list[int] = []  # decode tokens of each prefill step
    forward = mixed.runner.forward

    def recording(batch):
        if batch.forward_mode.is_extend():
            decoding.append(batch.num_decode)
        return forward(batch)

    mixed.runner.forward = recording
    assert _generate(mixed, prompts) == together
    assert sum(n > 0 for n in decoding) > 5, decoding
