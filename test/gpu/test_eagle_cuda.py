"""EAGLE and EAGLE-3 heads on CUDA (float32, so that drafts compare exactly): a tiny Llama target
and random heads of the published layout, under three sets of graph modes (full decode, verify
and draft graphs; breakable ones with tc_piecewise prefill and verify, where the target's
feature capture runs as an opaque op; everything eager). The drafts after the prefill and after
verify steps equal the reference drafter's (test/eagle_reference.py, fed transformers' hidden
states); whole runs equal plain greedy decoding; graphs run where the modes have them.
"""

from __future__ import annotations

import json

import pytest
import torch
from eagle_reference import LAYER_IDS, reference_drafts

from replaylm.entrypoints.engine import Engine
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from tiny_checkpoints import write_tiny_checkpoint, write_tiny_eagle_head

pytestmark = pytest.mark.gpu

STEPS = 3
PROMPTS = [[(5 * i + j % (3 + i)) % 200 + 3 for j in range(8 + 6 * i)] for i in range(8)]
MODES = {
    "full": {"decode": "full", "prefill": "breakable", "verify": "full", "draft": "full"},
    "breakable+tc_piecewise": {
        "decode": "breakable",
        "prefill": "tc_piecewise",
        "verify": "tc_piecewise",
        "draft": "breakable",
    },
    "eager": {"decode": "disabled", "prefill": "disabled", "verify": "disabled"},
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle_target")
    return str(path), write_tiny_checkpoint("llama3_deep", path).to(torch.float32)


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def head(request, target, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(f"{kind}_head")
    return kind, str(path), write_tiny_eagle_head(kind, path, target[1].config, layer_ids=LAYER_IDS)


def _engine(target_path: str, modes: dict[str, str] | None, head: tuple | None = None) -> Engine:
    flags: dict[str, object] = {}
    if head is not None:
        flags |= {
            "speculative_algorithm": head[0],
            "speculative_draft_model_path": head[1],
            "speculative_num_steps": STEPS,
        }
    if modes is not None:
        flags["cuda_graph_mode"] = json.dumps(modes)
    return Engine(
        model_path=target_path,
        device="cuda",
        dtype="float32",
        max_total_tokens=8000,
        max_running_requests=16,
        **flags,
    )


@pytest.fixture(scope="module")
def plain(target):
    engine = _engine(target[0], None)
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    out = engine.generate(input_ids=PROMPTS, sampling_params=params)
    engine.shutdown()
    return [o["output_ids"] for o in out]


@pytest.mark.parametrize("modes", list(MODES))
def test_drafts_equal_the_reference_and_runs_equal_plain_decoding(target, head, plain, modes):
    kind, _, tensors = head
    engine = _engine(target[0], MODES[modes], head)
    try:
        sched = engine.scheduler
        drafter = sched.speculation.drafter
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        reqs = [Req(f"r{i}", PROMPTS[i], params, i, 24) for i in (2, 5, 7)]
        for req in reqs:
            sched.add(req)
        sched.step()
        for _ in range(3):
            for req in reqs:
                ids = req.id_slice(0, req.num_ids)
                want = reference_drafts(kind, tensors, target[1], ids, STEPS)
                assert drafter.propose([req], [STEPS]) == [want], (req.rid, len(ids))
            drafter.accepted(reqs, [0] * len(reqs))
            sched.step()
        for req in reqs:
            sched.abort(req.rid)
        sched.run_to_completion()

        params_run = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        out = engine.generate(input_ids=PROMPTS, sampling_params=params_run)
        assert [o["output_ids"] for o in out] == plain
        assert sched.speculation.stats.drafted > 0
        verify = engine.runner.forward_stats.phases["verify"]
        draft = engine.draft_runner.forward_stats.phases["decode"]
        if modes == "eager":
            assert verify.graph == 0 and draft.graph == 0
        else:
            assert verify.graph > 0 and draft.graph > 0
    finally:
        engine.shutdown()
