"""--enable-vllm-metrics: the series the README maps to vLLM's names are served again under them,
sample for sample (counts, sums, buckets, labels) with `model_name` and `engine` added; without the
flag no vLLM name is served."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.runtime.io_struct import GenerateRequest, SchedulerStats
from replaylm.runtime.metrics import ServerMetrics
from replaylm.runtime.tokenizer_manager import TokenizerManager
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs
from replaylm.speculative.stats import SpeculationStats

from tiny_checkpoints import write_tiny_checkpoint

README = Path(__file__).resolve().parents[2] / "README.md"
VLLM_LABELS = {"model_name": "tiny-model", "engine": "0"}

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _readme_mapping() -> dict[str, tuple[str, str]]:
    """The README's list of vLLM names: vLLM name -> (type, the replaylm series served again)."""
    section = README.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^- `(vllm:\w+)` \((\w+)\): `(replaylm_\w+)`", section, re.MULTILINE)
    return {vllm: (kind, ours) for vllm, kind, ours in rows}


def _populated(metrics: ServerMetrics) -> str:
    speculation = SpeculationStats()
    speculation.record(drafts=3, accepted=2)
    metrics.set_scheduler_stats(
        SchedulerStats(
            num_running=3,
            num_waiting=2,
            kv_used_tokens=50,
            kv_total_tokens=200,
            num_retractions=1,
            prefix_prompt_tokens=40,
            prefix_cached_tokens=16,
            speculation=speculation,
        )
    )
    metrics.prompt_tokens.inc(30)
    metrics.generation_tokens.inc(7)
    metrics.first_token(0.2, arrived_wall=100.0, admitted_wall=100.05)
    metrics.itl.observe_many([0.004, 0.02, 0.3, 7.0])
    metrics.request_ended("stop", 10, 5, e2e=1.5, decode=1.3)
    metrics.request_ended("length", 20, 2, e2e=0.7, decode=0.5)
    metrics.request_ended("abort", 0, 0, e2e=0.01, decode=None)
    return metrics.render()[0].decode()


def _series(exposition: str) -> Series:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def _types(exposition: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE))


def _as_vllm(labels: frozenset[tuple[str, str]]) -> frozenset[tuple[str, str]]:
    renamed = {"finished_reason" if k == "finish_reason" else k: v for k, v in labels}
    return frozenset((renamed | VLLM_LABELS).items())


def test_vllm_names_serve_the_same_samples_as_replaylms():
    exposition = _populated(ServerMetrics("tiny-model"))
    served, types = _series(exposition), _types(exposition)
    mapping = _readme_mapping()
    assert {name: kind for name, (kind, _) in mapping.items()} == {
        name: kind for name, kind in types.items() if name.startswith("vllm:")
    }
    for vllm, (_, ours) in mapping.items():
        expected = {
            (vllm + name[len(ours) :], _as_vllm(labels)): value
            for (name, labels), value in served.items()
            if name.startswith(ours) and name[len(ours) :] in ("", "_bucket", "_sum", "_count")
        }
        theirs = {key: value for key, value in served.items() if key[0].startswith(vllm)}
        assert expected and theirs == expected, vllm
    abort = _as_vllm(frozenset({("finish_reason", "abort")}))
    assert served[("vllm:request_success_total", abort)] == 1
    assert served[("vllm:inter_token_latency_seconds_count", _as_vllm(frozenset()))] == 4


def test_without_the_flag_no_vllm_name_is_served():
    exposition = _populated(ServerMetrics())
    assert "replaylm_requests_total" in exposition and "vllm:" not in exposition


def test_the_flag_labels_the_served_model_name(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path)
    args = ServerArgs(
        model_path=str(tmp_path),
        device="cpu",
        max_total_tokens=256,
        served_model_name="tiny-model",
        enable_vllm_metrics=True,
    )
    manager = TokenizerManager(resolve_engine_config(args))

    async def one() -> None:
        params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        async for _ in manager.generate(GenerateRequest([5] * 8, params)):
            pass

    try:
        asyncio.run(one())
        served = _series(manager.metrics.render()[0].decode())
    finally:
        manager.shutdown()
    labels = _as_vllm(frozenset())
    assert served[("vllm:generation_tokens_total", labels)] == 5
    assert served[("vllm:prompt_tokens_total", labels)] == 8
    assert served[("vllm:e2e_request_latency_seconds_count", labels)] == 1
