"""TokenizerManager with a real scheduler child process (tiny checkpoint: starts in seconds)."""

from __future__ import annotations

import asyncio
import json
from itertools import accumulate

import pytest

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.runtime.errors import RequestError, ServiceUnavailableError
from replaylm.runtime.io_struct import GenerateOutput, GenerateRequest, TextFrame
from replaylm.runtime.tokenizer_manager import TokenizerManager
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

from tiny_checkpoints import write_tiny_checkpoint

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def manager(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path)
    tm = TokenizerManager(
        resolve_engine_config(
            ServerArgs(
                model_path=str(tmp_path), device="cpu", max_total_tokens=256, max_running_requests=4
            )
        )
    )
    yield tm
    tm.shutdown()


async def _collect(tm: TokenizerManager, ids: list[int], **params) -> list:
    req = GenerateRequest(ids, SamplingParams(**{**GREEDY, **params}), top_logprobs=3)
    return [out async for out in tm.generate(req)]


def test_generates_with_logprobs_and_usage(manager):
    outs = asyncio.run(_collect(manager, [5, 6, 7], max_new_tokens=6))
    # a token a step, but steps that queued while the consumer was busy come joined
    assert sum(len(o.token_ids) for o in outs) == 6 and all(o.token_ids for o in outs)
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    assert [o.completion_tokens for o in outs] == list(accumulate(len(o.token_ids) for o in outs))
    assert outs[-1].finish_reason.type == "length"
    assert outs[-1].completion_tokens == 6 and outs[-1].prompt_tokens == 3
    lp = outs[0].logprobs[0]
    assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert lp.token_id == lp.top[0][0] and lp.logprob == lp.top[0][1]  # greedy = most likely


def test_bad_input_is_rejected_before_anything_is_queued(manager):
    with pytest.raises(RequestError, match="prompt has 300 tokens"):
        asyncio.run(_collect(manager, [5] * 300))
    with pytest.raises(RequestError) as err:
        asyncio.run(_collect(manager, [5], temperature=-1.0))
    assert err.value.param == "temperature"
    for field, value in (("logit_bias", {320: 1.0}), ("stop_token_ids", [320])):  # vocab 320
        with pytest.raises(RequestError, match="outside the vocabulary") as err:
            asyncio.run(_collect(manager, [5], **{field: value}))
        assert err.value.param == field


def test_closing_the_stream_aborts_and_frees_kv(manager):
    async def partial() -> None:
        req = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=200, **GREEDY))
        gen = manager.generate(req)
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(50):  # the scheduler reports the freed KV in its next message
            await asyncio.sleep(0.05)
            if manager.metrics.kv_used._value.get() == 0:
                return

    asyncio.run(partial())
    assert manager.metrics.kv_used._value.get() == 0
    assert manager.metrics.requests.labels("abort")._value.get() == 1


def test_child_death_is_reported_not_hung(manager):
    async def killed_mid_request() -> None:
        req = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=100000, **GREEDY))
        gen = manager.generate(req)
        await gen.__anext__()
        manager._scheduler.proc.kill()
        with pytest.raises(ServiceUnavailableError):
            async for _ in gen:
                pass

    asyncio.run(asyncio.wait_for(killed_mid_request(), 30))
    assert not manager.healthy()
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(_collect(manager, [5]))


def test_choices_of_one_request_are_told_apart_by_index(manager):
    """n=3: every choice streams its own tokens under one request id; greedy choices agree,
    seeded sampled ones follow seed, seed + 1, seed + 2; the prompt logprobs come once a choice."""

    async def run(n: int, **params) -> dict[int, list]:
        req = GenerateRequest(
            [5, 6, 7, 8], SamplingParams(**{**GREEDY, **params}), prompt_logprobs=2, n=n
        )
        by_choice: dict[int, list] = {}
        async for out in manager.generate(req):
            assert out.rid == req.rid
            by_choice.setdefault(out.index, []).append(out)
        return by_choice

    def tokens(outs: list) -> list[int]:
        return [t for o in outs for t in o.token_ids]

    greedy = asyncio.run(run(3, max_new_tokens=5))
    assert sorted(greedy) == [0, 1, 2]
    assert len({tuple(tokens(outs)) for outs in greedy.values()}) == 1
    for outs in greedy.values():
        assert outs[-1].finish_reason.type == "length"
        # on the choice's first increment only (later steps may come joined to it or apart)
        assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
        assert len(tokens(outs)) == 5
        assert len(outs[0].prompt_logprobs) == 4 and outs[0].prompt_logprobs[0] is None
    sampled = asyncio.run(run(3, max_new_tokens=8, temperature=1.0, seed=40))
    singles = [asyncio.run(run(1, max_new_tokens=8, temperature=1.0, seed=s)) for s in (40, 41, 42)]
    assert [tokens(sampled[i]) for i in range(3)] == [tokens(s[0]) for s in singles]
    assert len({tuple(tokens(outs)) for outs in sampled.values()}) > 1
    with pytest.raises(RequestError) as err:
        asyncio.run(run(5, max_new_tokens=2))  # more choices than running slots
    assert err.value.param == "n"


@pytest.fixture
def text_manager(tmp_path):
    """A tiny model of SmolLM2's vocabulary with the built-in model's tokenizer: text out."""
    write_tiny_checkpoint("llama_smollm2_vocab", tmp_path)
    args = ServerArgs(
        model_path=str(tmp_path),
        tokenizer_path="smollm2-135m-instruct",
        device="cpu",
        max_total_tokens=256,
        max_running_requests=4,
    )
    tm = TokenizerManager(resolve_engine_config(args))
    yield tm
    tm.shutdown()


def test_text_only_increments_come_rendered_by_the_frame(text_manager):
    """With a frame renderer, every increment that brings text alone comes as its frame (joined
    when they queue up); the first and the last come whole; the text is the plain stream's."""

    async def run(frame):
        req = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=40, **GREEDY))
        return [out async for out in text_manager.generate(req, frame)]

    plain = asyncio.run(run(None))
    framed = asyncio.run(run(TextFrame(_render)))
    assert isinstance(framed[0], GenerateOutput) and isinstance(framed[-1], GenerateOutput)
    assert framed[-1].finish_reason.type == "length" and framed[-1].completion_tokens == 40
    text, frames = "", 0
    for item in framed:
        if isinstance(item, GenerateOutput):
            text += item.text
            continue
        for event in item.split(b"\0")[:-1]:
            index, piece = json.loads(event)
            assert index == 0 and piece
            text, frames = text + piece, frames + 1
    assert frames >= 10  # most of the 40 tokens' text came as frames
    assert text == "".join(out.text for out in plain) != ""


def _render(index: int, text: str) -> bytes:
    return json.dumps([index, text]).encode() + b"\0"


def _text_of(items: list) -> str:
    text = ""
    for item in items:
        if isinstance(item, GenerateOutput):
            text += item.text
            continue
        for event in item.split(b"\0")[:-1]:
            text += json.loads(event)[1]
    return text


def test_frames_are_written_at_once_while_the_stream_waits_in_order(text_manager):
    """With `send` set, a frame that finds the stream waiting (all before it written) is
    written through it at once, no output yielded; a write left unfinished (a full buffer)
    holds the next outputs back until it ends: one timeline of the stream's writes gives the
    plain stream's text."""

    async def run(frame):
        req = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=40, **GREEDY))
        timeline: list = []
        written = 0

        def send(event: bytes):
            nonlocal written
            written += 1
            if written % 3:
                timeline.append(event)
                return None

            async def later() -> None:  # the buffer was full: written a little later
                await asyncio.sleep(0.01)
                timeline.append(event)

            return later()

        if frame is not None:
            frame.send = send
        async for out in text_manager.generate(req, frame):
            timeline.append(out)
        return timeline, written

    plain, _ = asyncio.run(run(None))
    timeline, written = asyncio.run(run(TextFrame(_render)))
    assert written >= 10  # most frames went out through send
    assert isinstance(timeline[0], GenerateOutput) and isinstance(timeline[-1], GenerateOutput)
    assert _text_of(timeline) == _text_of(plain) != ""
