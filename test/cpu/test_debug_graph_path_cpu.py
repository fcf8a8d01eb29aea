"""The graph path on the CPU: with `--debug-cuda-graph`, the modes the traits table marks
debug-eager (`breakable`, `tc_piecewise`) run their whole runner/backend path eagerly (shapes,
static buffers, padding, the breakable primitive in eager mode, the compiled forward), so the
real scheduler through it must generate what eager generates."""

from __future__ import annotations

import json

import pytest

from replaylm.entrypoints.engine import Engine
from replaylm.model_executor.cuda_graph.config import debug_eager_modes
from replaylm.model_executor.forward_batch import ForwardMode

from tiny_checkpoints import write_tiny_checkpoint

PROMPTS = [[(11 * i + 7 * j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(6)]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    write_tiny_checkpoint("qwen3", folder)
    return str(folder)


def _generate(checkpoint: str, **kwargs) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path=checkpoint, device="cpu", max_total_tokens=2048, max_running_requests=8, **kwargs
    )
    out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [o["output_ids"] for o in out], engine


@pytest.mark.parametrize("mode", debug_eager_modes())
def test_debug_graph_path_generates_what_eager_generates(checkpoint, mode):
    want, _ = _generate(checkpoint)
    got, engine = _generate(
        checkpoint,
        debug_cuda_graph=True,
        tc_piecewise_compiler="eager",
        cuda_graph_mode=json.dumps({"decode": mode, "prefill": mode}),
        decode_cuda_graph_bs=[1, 2, 4, 8],
        prefill_cuda_graph_tokens=[64, 256],
    )
    assert got == want
    stats = engine.runner.forward_stats.phases
    assert stats["prefill"].graph > 0 and stats["decode"].graph > 0  # the graph path ran
    assert stats["decode"].padding_tokens > 0  # 6 live requests padded to the shape 8
    # batches are built in the inputs of the shape that replays them (none past the largest)
    decode, prefill = (engine.runner.graph_runners[p] for p in ("decode", "prefill"))
    assert decode.inputs_for(ForwardMode.DECODE, 6, 6) is decode.inputs[8]
    assert decode.inputs_for(ForwardMode.DECODE, 9, 9) is None
    assert decode.inputs_for(ForwardMode.DECODE, 0, 0) is None
    assert decode.inputs_for(ForwardMode.EXTEND, 6, 6) is None
    assert prefill.inputs_for(ForwardMode.EXTEND, 3, 100) is prefill.inputs[256]
    assert prefill.inputs_for(ForwardMode.EXTEND, 3, 300) is None
    graph_stats = engine.runner.cuda_graph_stats()
    assert set(graph_stats) == {"decode", "prefill"}
    for phase, shapes in (("decode", 4), ("prefill", 2)):
        assert graph_stats[phase]["mode"] == mode and graph_stats[phase]["shapes"] == shapes
        # what the backend reports through stats(): tc_piecewise's compile time, else None
        assert (graph_stats[phase]["compile_s"] is not None) == (mode == "tc_piecewise")


@pytest.mark.parametrize("mode", debug_eager_modes())
def test_verify_graph_path_generates_what_eager_generates(checkpoint, mode):
    """Speculative decoding's verify steps through the verify phase's graph runner (decode rows,
    up to 8 requests x 4 tokens) and the draft model's steps through its decode graphs: the
    same tokens as plain eager decoding; the decode and prefill runners never take a verify
    batch, nor the verify runner a DECODE or EXTEND one."""
    want, _ = _generate(checkpoint)
    got, engine = _generate(
        checkpoint,
        debug_cuda_graph=True,
        tc_piecewise_compiler="eager",
        cuda_graph_mode=json.dumps(
            {"decode": mode, "prefill": mode, "verify": mode, "draft": mode}
        ),
        speculative_algorithm="draft_model",
        speculative_draft_model_path=checkpoint,
        speculative_max_bs=8,
    )
    assert got == want
    stats = engine.runner.forward_stats.phases
    assert stats["verify"].graph > 0 and stats["verify"].eager == 0
    assert engine.scheduler.speculation.stats.accepted > 0
    verify, decode, prefill = (
        engine.runner.graph_runners[p] for p in ("verify", "decode", "prefill")
    )
    assert verify.shapes == (1, 2, 4, 8, 16, 24, 32)  # rows: 8 requests x (3 drafts + 1)
    assert verify.inputs_for(ForwardMode.TARGET_VERIFY, 21, 21) is verify.inputs[24]
    for other in (ForwardMode.EXTEND, ForwardMode.DECODE):
        assert verify.inputs_for(other, 21, 21) is None
    assert decode.inputs_for(ForwardMode.TARGET_VERIFY, 21, 21) is None
    assert prefill.inputs_for(ForwardMode.TARGET_VERIFY, 21, 21) is None
    # the draft model's decode steps: its own runner's graphs, in the draft phase's mode
    draft = engine.draft_runner
    assert draft.cuda_graph_stats()["decode"]["mode"] == mode
    assert draft.forward_stats.phases["decode"].graph > 0
