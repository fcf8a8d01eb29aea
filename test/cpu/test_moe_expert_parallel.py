"""Expert parallelism's checks and a mixture of experts' tokens per expert, on the CPU.

`--enable-expert-parallel` is refused at one rank and for a dense model, naming the flag, and
for experts that do not split over `--tp-size`, naming that. (Its outputs and each rank's
experts: test_moe_models.py.) Every MoE layer's device counters equal a host count of the
router's choices (`select_experts`, `torch.bincount`) after forwards, eager or through the graph
path, whose padding rows are left out; compiled, the count reads the attention_context's batch.
The scheduler's reader sums them over the layers (and per rank under expert parallelism), and
/metrics of a real two-rank expert-parallel server on a tiny Qwen3-MoE shows them after a
request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import httpx
import pytest
import torch

from replaylm.distributed.parallel_state import TPPlace
from replaylm.layers.attention.ops import attention_context
from replaylm.layers.moe.layer import FusedMoE, SparseMoeBlock
from replaylm.layers.moe.routing import LiveTokens, route, select_experts
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.expert_tokens import ExpertTokenReader
from replaylm.model_executor.forward_batch import ForwardBatch
from replaylm.model_executor.forward_stats import ExpertTokens
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.models.config import ModelConfig
from replaylm.models.llama import LlamaForCausalLM
from replaylm.models.moe import Qwen3MoeForCausalLM, check_expert_split
from replaylm.runtime.io_struct import SchedulerStats
from replaylm.runtime.metrics import ServerMetrics
from replaylm.server_args import ServerArgs

from http_helpers import PROMPT, TIMEOUT_S, samples, scrape
from model_parity import scripted_logits
from server_process import ServerProcess
from tiny_checkpoints import write_tiny_checkpoint

EXPERTS, TOP_K = 8, 2  # TINY_MOE_CONFIGS' qwen3_moe: both of its 2 layers sparse
PROMPT_LENS, DECODE_STEPS = (5, 40, 17), 3
# live tokens `scripted_logits` runs: the prompts, then a token per request and step
LIVE_TOKENS = sum(PROMPT_LENS) + DECODE_STEPS * len(PROMPT_LENS)
# breakable graphs run eagerly on the CPU: 62 prompt tokens padded to 64, 3 requests to 4
GRAPH_PATH = {
    "debug_cuda_graph": True,
    "cuda_graph_mode": json.dumps({"decode": "breakable", "prefill": "breakable"}),
    "decode_cuda_graph_bs": [4, 8],
    "prefill_cuda_graph_tokens": [64, 128],
}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen3_moe")
    write_tiny_checkpoint("qwen3_moe", folder)
    return folder


def _config(**changes: object) -> ModelConfig:
    base = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": 8,
    }
    return ModelConfig.from_dict({**base, **changes})


def test_expert_parallel_needs_two_ranks() -> None:
    args = ServerArgs(enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"^--enable-expert-parallel needs --tp-size 2 or more"):
        args.validate()


def test_expert_parallel_needs_a_mixture_of_experts_model() -> None:
    """Checked before any rank builds anything; a Qwen MoE config without experts is dense."""
    message = "--enable-expert-parallel needs a mixture-of-experts model; {} has no experts".format
    dense = _config(architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=f"^{message('LlamaForCausalLM')}$"):
        check_expert_split(LlamaForCausalLM, dense, 2, True)
    with pytest.raises(ValueError, match=f"^{message('Qwen3MoeForCausalLM')}$"):
        check_expert_split(Qwen3MoeForCausalLM, _config(num_experts=0), 2, True)


def test_experts_must_split_over_the_ranks_whole() -> None:
    check_expert_split(Qwen3MoeForCausalLM, _config(), 4, True)
    with pytest.raises(ValueError, match=r"^--tp-size 3 does not divide the model's 8 experts"):
        check_expert_split(Qwen3MoeForCausalLM, _config(), 3, True)


def test_expert_columns_must_split_over_the_ranks_before_any_builds() -> None:
    """Without expert parallelism each expert's columns (and the shared expert's) split."""
    check_expert_split(LlamaForCausalLM, _config(architectures=["LlamaForCausalLM"]), 3, False)
    columns = _config(moe_intermediate_size=30)
    check_expert_split(Qwen3MoeForCausalLM, columns, 2, False)
    with pytest.raises(ValueError, match=r"^--tp-size 4 does not divide the model's 30 expert"):
        check_expert_split(Qwen3MoeForCausalLM, columns, 4, False)


def _runner(folder: Path, **args: object) -> ModelRunner:
    server_args = ServerArgs(
        model_path=str(folder),
        device="cpu",
        dtype="float32",
        max_total_tokens=512,
        max_running_requests=8,
        **args,  # type: ignore[arg-type]
    )
    return load_model_runner(resolve_engine_config(server_args))


def _count_routing_on_the_host(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Per MoE layer (by name), a host count of what its router chooses in later forwards:
    `select_experts` of the router's logits, a bincount over the live rows (those whose KV
    slot is not the padding slot 0: the model tells its layers which, before each forward)."""
    counts: dict[str, torch.Tensor] = {}
    for name, block in runner.model.named_modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        counts[name] = torch.zeros(EXPERTS, dtype=torch.int64)

        def count(_gate, _inputs, logits, name=name, experts=block.experts) -> None:
            _, ids = select_experts(logits, experts.top_k, experts.renormalize)
            live = ids[experts.live.slots != 0].reshape(-1)
            counts[name] += torch.bincount(live.long(), minlength=EXPERTS)

        block.gate.register_forward_hook(count)
    return counts


@pytest.mark.parametrize("path", ["eager", "graph"])
def test_counts_equal_a_host_count_of_the_routing(qwen3_moe: Path, path: str) -> None:
    """A ragged prefill and decode steps; on the graph path the batches are padded (captured
    all-padding batches counted nothing either), and the padding is not counted."""
    runner = _runner(qwen3_moe, **(GRAPH_PATH if path == "graph" else {}))
    layers = {name: m for name, m in runner.model.named_modules() if isinstance(m, FusedMoE)}
    assert len(layers) == 2 and all(m.routed_tokens.sum() == 0 for m in layers.values())
    host = _count_routing_on_the_host(runner)
    scripted_logits(runner, PROMPT_LENS, DECODE_STEPS, first_decode_id=200)
    padding = sum(phase.padding_tokens for phase in runner.forward_stats.phases.values())
    assert (padding > 0) == (path == "graph")
    for name, experts in layers.items():
        assert experts.routed_tokens.tolist() == host[name.removesuffix(".experts")].tolist()
        assert experts.routed_tokens.sum() == TOP_K * LIVE_TOKENS
    assert runner.expert_tokens is not None
    total = sum(m.routed_tokens for m in layers.values())
    assert runner.expert_tokens.read() == ExpertTokens(total.tolist())


def test_compiled_count_reads_the_attention_context_batch() -> None:
    """Under torch.compile the routing's count is one custom op reading the open context's
    batch (the model's `live` slots are not read)."""
    counts = torch.zeros(EXPERTS, dtype=torch.int64)
    logits = torch.zeros(3, EXPERTS)
    for token, (first, second) in enumerate([(0, 3), (3, 5), (7, 0)]):
        logits[token, first], logits[token, second] = 2.0, 1.0
    batch = cast(ForwardBatch, SimpleNamespace(out_cache_loc=torch.tensor([5, 9, 0])))

    def routed(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, TOP_K, True, counts, LiveTokens())

    with attention_context(batch, []):
        _, ids = torch.compile(routed, backend="aot_eager", fullgraph=True)(logits)
    assert ids.tolist() == [[0, 3], [3, 5], [7, 0]]
    assert counts.tolist() == [1, 0, 0, 2, 0, 1, 0, 0]  # the padding row's: not


def test_reader_sums_the_layers_and_each_ranks_experts() -> None:
    """Under expert parallelism (rank 1 of 2 here) every rank counts every expert."""
    layers = [FusedMoE(4, 16, 8, TOP_K, True, TPPlace(1, 2, expert_parallel=True)) for _ in "ab"]
    reader = ExpertTokenReader(layers)
    assert reader.read() == ExpertTokens([0, 0, 0, 0], [0, 0])
    layers[0].routed_tokens += torch.tensor([1, 2, 3, 4])
    layers[1].routed_tokens += torch.tensor([10, 0, 0, 1])
    assert reader.read() == ExpertTokens([11, 2, 3, 5], [13, 8])


def _stats(expert_tokens: ExpertTokens | None) -> SchedulerStats:
    return SchedulerStats(0, 0, 0, 100, 0, expert_tokens=expert_tokens)


def test_metrics_show_tokens_per_expert_and_rank_for_a_mixture_of_experts_only() -> None:
    metrics = ServerMetrics()
    metrics.set_scheduler_stats(_stats(None))
    served = samples(metrics.render()[0].decode())
    assert not [key for key in served if key.startswith("replaylm_moe_")]
    metrics.set_scheduler_stats(_stats(ExpertTokens([3, 0, 5, 1], [3, 6])))
    served = samples(metrics.render()[0].decode())
    assert {k: v for k, v in served.items() if k.startswith("replaylm_moe_")} == {
        'replaylm_moe_expert_tokens{expert="0"}': 3.0,
        'replaylm_moe_expert_tokens{expert="1"}': 0.0,
        'replaylm_moe_expert_tokens{expert="2"}': 5.0,
        'replaylm_moe_expert_tokens{expert="3"}': 1.0,
        'replaylm_moe_rank_tokens{rank="0"}': 3.0,
        'replaylm_moe_rank_tokens{rank="1"}': 6.0,
    }


@pytest.fixture(scope="module")
def expert_parallel_server(server_factory, tmp_path_factory) -> Iterator[httpx.Client]:
    """A tiny Qwen3-MoE of SmolLM2's vocabulary on 2 expert-parallel ranks, SmolLM2's
    tokenizer serving it text."""
    folder = tmp_path_factory.mktemp("tiny_qwen3_moe_smollm2_vocab")
    write_tiny_checkpoint("qwen3_moe_smollm2_vocab", folder)
    server: ServerProcess = server_factory(
        "--model-path",
        str(folder),
        "--tokenizer-path",
        resolve_model_path("smollm2-135m-instruct"),
        "--tp-size",
        "2",
        "--enable-expert-parallel",
        "--max-total-tokens",
        "512",
        "--max-running-requests",
        "4",
    )
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as client:
        yield client


def test_a_served_mixture_of_experts_shows_its_tokens_per_expert_and_rank(
    expert_parallel_server: httpx.Client,
) -> None:
    """Each token the request ran (its prompt, then all but its last output token) was routed
    to 2 experts in each of 2 layers, and the CPU's counts are read at every step, the last
    included; rank r holds experts 4r..4r+3."""
    http = expert_parallel_server
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    response.raise_for_status()
    usage = response.json()["usage"]
    served = scrape(http)
    experts = [served[f'replaylm_moe_expert_tokens{{expert="{e}"}}'] for e in range(EXPERTS)]
    ranks = [served[f'replaylm_moe_rank_tokens{{rank="{r}"}}'] for r in range(2)]
    assert ranks == [sum(experts[:4]), sum(experts[4:])]
    assert sum(experts) == 2 * TOP_K * (usage["prompt_tokens"] + usage["completion_tokens"] - 1)
