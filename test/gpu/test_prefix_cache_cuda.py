"""The prefix cache on CUDA (SmolLM2, bfloat16, triton attention): extend batches whose requests
start from cached prefixes of any length run through every prefill mode and give eager's greedy
answers (divergences only at near-ties, as in test_mode_cells_server.py); under
`--deterministic` a request's output does not depend on whether its prefix came from the cache."""

from __future__ import annotations

import json

import pytest

from replaylm.entrypoints.engine import Engine
from replaylm.server_args import ServerArgs

from model_parity import divergence_gaps

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.5
SYSTEM = (
    "You are a patient teacher. Explain each topic to a curious twelve-year-old in two or three "
    "plain sentences, with one concrete example from everyday life, and never use jargon."
)
TOPICS = ["gravity", "rain", "magnets", "volcanoes", "bread", "echoes", "tides", "rust"]
PARAMS = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def _engine(**kw) -> Engine:
    base = dict(device="cuda", dtype="bfloat16", max_total_tokens=60000, max_running_requests=64)
    return Engine(**vars(ServerArgs(**{**base, **kw})))


def _prompts(engine: Engine) -> list[list[int]]:
    """Chats sharing a system prompt; every third asks a follow-up, so prefix lengths vary."""
    prompts = []
    for i, topic in enumerate(TOPICS * 3):
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {topic}?"},
        ]
        if i % 3 == 2:
            messages += [
                {"role": "assistant", "content": f"{topic.capitalize()} is a thing we see often."},
                {"role": "user", "content": "Can you give another example?"},
            ]
        prompts.append(engine.encode_chat(messages))
    return prompts


def _outputs(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=PARAMS)]


@pytest.mark.parametrize("prefill", ["breakable", "tc_piecewise", "disabled"])
def test_cached_prefixes_in_every_prefill_mode_match_eager(prefill):
    mode = json.dumps({"decode": "full", "prefill": prefill})
    eager = _engine(disable_cuda_graph=True, disable_radix_cache=True)
    prompts = _prompts(eager)
    want = _outputs(eager, prompts)
    graph = _engine(cuda_graph_mode=mode)
    cold = _outputs(graph, prompts)  # later batches find the system prompt cached
    warm = _outputs(graph, prompts)  # every prompt but its last token cached
    stats = graph.scheduler.stats()
    assert stats.prefix_cached_tokens > len(prompts) * len(SYSTEM) // 8
    if prefill != "disabled":
        assert graph.runner.forward_stats.phases["prefill"].graph > 0
    diverging = 0
    for name, got in (("cold", cold), ("warm", warm)):
        gaps = divergence_gaps(eager.runner, prompts, got, want)
        print(f"{prefill} {name}: {len(gaps)} of {len(prompts)} diverge; top-2 gaps: {gaps}")
        assert all(g <= NEAR_TIE for g in gaps.values()), gaps
        diverging += len(gaps)
    if diverging:
        # bf16: a prefix computed in another batch (or with this batch's graph padding) rounds
        # differently and flips near-ties; measured on the H100: half of these chats part from
        # eager's, all at top-2 gaps of 0.005-0.13, in every prefill mode alike. Exactness is
        # what the --deterministic test below checks.
        pytest.xfail(f"{diverging} generations part from eager's, every one at a near-tie")


def test_deterministic_outputs_do_not_depend_on_the_cache():
    engine = _engine(deterministic=True)
    prompts = _prompts(engine)
    computed = []
    for prompt in prompts:  # each alone, on an empty cache: every token computed
        engine.scheduler.prefix_cache.flush()
        (out,) = engine.generate(input_ids=[prompt], sampling_params=PARAMS)
        assert out["meta_info"]["cached_tokens"] == 0
        computed.append(out["output_ids"])
    engine.scheduler.prefix_cache.flush()
    _outputs(engine, prompts[:1])  # caches the system prompt
    outs = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert [o["output_ids"] for o in outs] == computed
