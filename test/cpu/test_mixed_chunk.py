"""Mixed steps (`--enable-mixed-chunk`): the running requests' decode tokens ride in prefill
steps. On a tiny checkpoint every request must generate what it generates alone (greedy), with
prompts chunked at every offset, requests joining mid-run, an abort, retraction under a tiny KV
pool, the overlap schedule on and off, and the graph path (`--debug-cuda-graph`); no step may
hold more tokens than its budget, and every slot comes back."""

from __future__ import annotations

import json

import pytest
from kv_accounting import assert_kv_released

from replaylm.entrypoints.engine import Engine
from replaylm.model_executor.forward_batch import ForwardBatch
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

GREEDY = {"ignore_eos": True, "temperature": 0.0}
MAX_NEW = 14
PROMPTS = [[(7 * i + 3 * j) % 300 + 3 for j in range(3 + 5 * i)] for i in range(10)]  # 3..48


@pytest.fixture(scope="module")
def alone(tiny_llama3) -> list[list[int]]:
    """Each prompt's greedy output when it runs by itself."""
    engine = Engine(model_path=tiny_llama3, device="cpu", max_total_tokens=2000)
    params = {"max_new_tokens": MAX_NEW, **GREEDY}
    return [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]


def _recorded_batches(engine: Engine) -> list[ForwardBatch]:
    """Every batch the engine's runner is given from now on (the real forward still runs)."""
    batches: list[ForwardBatch] = []
    forward = engine.runner.forward

    def recording(batch: ForwardBatch):
        batches.append(batch)
        return forward(batch)

    engine.runner.forward = recording  # type: ignore[method-assign]
    return batches


def _run_in_waves(engine: Engine, abort: int | None = None) -> list[Req]:
    """The prompts arrive in three waves while earlier ones decode; `abort` is cancelled as the
    third wave comes."""
    sched = engine.scheduler
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=MAX_NEW, **GREEDY), 0, MAX_NEW)
        for i, p in enumerate(PROMPTS)
    ]
    for start, end in ((0, 3), (3, 7), (7, len(reqs))):
        if abort is not None and start == 7:
            assert sched.abort(f"r{abort}") is reqs[abort]
        for req in reqs[start:end]:
            sched.add(req)
        for _ in range(3):
            sched.step()
    sched.run_to_completion()
    return reqs


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_steps_equal_each_request_alone(tiny_llama3, alone, overlap):
    budget = 20
    engine = Engine(
        model_path=tiny_llama3,
        device="cpu",
        max_total_tokens=2000,
        chunked_prefill_size=16,
        max_prefill_tokens=budget,
        enable_mixed_chunk=True,
        disable_overlap_schedule=not overlap,
    )
    batches = _recorded_batches(engine)
    reqs = _run_in_waves(engine, abort=4)
    for i, req in enumerate(reqs):
        if i == 4:
            assert req.finish_reason.type == "abort"
        else:
            assert req.output_ids == alone[i], i
    mixed = [b for b in batches if b.num_decode]
    assert len(mixed) >= 5, [(b.num_tokens, b.num_decode) for b in batches]
    for batch in mixed:
        assert batch.forward_mode.is_extend()
        assert batch.num_tokens <= budget  # decode tokens count in the step's budget
        assert batch.extend_seq_lens_cpu[: batch.num_decode] == [1] * batch.num_decode
        assert batch.num_tokens > batch.num_decode  # something was prefilled beside them
    assert_kv_released(engine)


def test_mixed_steps_keep_every_output_through_retraction(tiny_llama3, alone):
    """A KV pool too small for the prompts' outputs: running requests are retracted and
    recomputed (in mixed steps, beside the decoding ones) and nothing changes."""
    engine = Engine(
        model_path=tiny_llama3,
        device="cpu",
        max_total_tokens=120,
        chunked_prefill_size=16,
        enable_mixed_chunk=True,
    )
    engine.scheduler.new_token_ratio = engine.scheduler.min_new_token_ratio = 0.0
    batches = _recorded_batches(engine)
    reqs = _run_in_waves(engine)
    assert [r.output_ids for r in reqs] == alone
    assert engine.scheduler.num_retractions > 0
    assert any(b.num_decode for b in batches)
    assert_kv_released(engine)


def test_no_room_beside_the_running_requests_prefills_alone(tiny_llama3, alone):
    """When the running requests alone fill the step's budget, a prefill step runs without them
    (as with mixing off) rather than starving the waiting prompts."""
    engine = Engine(
        model_path=tiny_llama3,
        device="cpu",
        max_total_tokens=2000,
        chunked_prefill_size=4,
        max_prefill_tokens=4,
        enable_mixed_chunk=True,
    )
    batches = _recorded_batches(engine)
    reqs = _run_in_waves(engine)
    assert [r.output_ids for r in reqs] == alone
    assert all(b.num_tokens <= 4 for b in batches if b.forward_mode.is_extend())
    plain = [b for b in batches if b.forward_mode.is_extend() and not b.num_decode]
    assert len(plain) > 1  # the first prefill, and those with 4+ requests running


def test_the_graph_path_serves_mixed_batches(tiny_llama3, alone):
    """Under `--debug-cuda-graph` the breakable prefill runner takes mixed batches: its static
    buffers and padding request keep the decode tokens first."""
    engine = Engine(
        model_path=tiny_llama3,
        device="cpu",
        max_total_tokens=2000,
        max_running_requests=16,
        chunked_prefill_size=32,
        enable_mixed_chunk=True,
        debug_cuda_graph=True,
        cuda_graph_mode=json.dumps({"decode": "breakable", "prefill": "breakable"}),
        decode_cuda_graph_bs=[1, 2, 4, 8, 16],
        prefill_cuda_graph_tokens=[16, 32],
    )
    batches = _recorded_batches(engine)
    reqs = _run_in_waves(engine)
    assert [r.output_ids for r in reqs] == alone
    assert any(b.num_decode for b in batches)
    stats = engine.runner.forward_stats.phases
    assert stats["prefill"].graph > 0 and stats["prefill"].eager == 0
    assert stats["prefill"].padding_tokens > 0
    assert_kv_released(engine)


def test_prompt_logprobs_beside_decoding_requests(tiny_llama3):
    """A request asking for prompt logprobs, prefilled in chunks beside running decodes: its
    scored rows come after the decode tokens, and its scores equal those of it alone."""
    prompt = PROMPTS[-1]

    def scores(engine: Engine, others: list[list[int]]) -> list:
        sched = engine.scheduler
        for i, p in enumerate(others):
            sched.add(Req(f"o{i}", p, SamplingParams(max_new_tokens=30, **GREEDY), 0, 30))
        for _ in range(3):
            sched.step()  # the others are decoding now
        req = Req("scored", prompt, SamplingParams(max_new_tokens=2, **GREEDY), 0, 2)
        req.prompt_logprobs = 3
        sched.add(req)
        outputs = []
        while sched.has_work:
            outputs += [o.prompt_logprobs for o in sched.step() if o.prompt_logprobs is not None]
        assert len(outputs) == 1
        return outputs[0]

    kwargs = {"max_total_tokens": 2000, "chunked_prefill_size": 16, "max_prefill_tokens": 20}
    alone = scores(Engine(model_path=tiny_llama3, device="cpu", **kwargs), [])
    mixed = Engine(model_path=tiny_llama3, device="cpu", enable_mixed_chunk=True, **kwargs)
    batches = _recorded_batches(mixed)
    got = scores(mixed, PROMPTS[:3])
    assert any(b.num_decode for b in batches)
    assert len(got) == len(alone) == len(prompt)
    for a, b in zip(got, alone, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert_kv_released(mixed)
