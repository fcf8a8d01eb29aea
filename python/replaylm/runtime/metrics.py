"""Prometheus metrics of the server (`GET /metrics`), kept by the front ends.

Request, token and latency series are observed by each front end's tokenizer manager as outputs
arrive, once per request (per choice) when its first token arrives and when it ends; the
scheduler's gauges (queue, running, KV usage, running totals such as preemptions or a mixture of
experts' tokens per expert) are set from the stats it sends every step. With several front ends
(`--api-server-count`) prometheus_client runs in multiprocess mode: each process's values live
in files of a shared folder, and a scrape of any front end sums them (the scheduler's gauges:
the latest). The README's metrics table documents
every series; a test keeps the two equal. With --enable-vllm-metrics, those with a vLLM
equivalent are served again under vLLM's names.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from replaylm.model_executor.forward_stats import ExpertTokens
from replaylm.runtime.io_struct import SchedulerStats
from replaylm.speculative.stats import SpeculationStats

# no `*_created` twin of every counter and histogram: Prometheus detects counter resets itself
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1 .. 500k


class BatchHistogram:
    """A prometheus_client Histogram observed a batch at a time: a batch is binned here, then
    added with one increment per bucket it reaches, where `Histogram.observe` takes a lock per
    value. prometheus_client has no public batch observe, so this adds to the Histogram's own
    values (`_buckets`, `_sum`), which also live in its shared files in multiprocess mode."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self.histogram = Histogram(name, documentation, buckets=buckets, registry=registry)
        self.bounds = list(self.histogram._upper_bounds)  # the last is +Inf

    def observe_many(self, values: Sequence[float]) -> None:
        if not values:
            return
        counts = [0] * len(self.bounds)
        for value in values:
            counts[bisect.bisect_left(self.bounds, value)] += 1
        self.histogram._sum.inc(sum(values))
        for bucket, count in zip(self.histogram._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


class ServerMetrics:
    """One registry per server, so several servers (tests) never share series. `vllm_model_name`:
    also serve vLLM's names (`VllmNames`), labelled with this model name."""

    def __init__(self, vllm_model_name: str | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "replaylm_requests",
            "requests ended, by finish reason (stop, length, abort)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("replaylm_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "replaylm_generation_tokens", "generated tokens", registry=r
        )
        self.running = self._gauge("num_running_requests", "requests decoding")
        self.waiting = self._gauge("num_waiting_requests", "requests queued")
        self.kv_used = self._gauge(
            "kv_used_tokens", "KV cache slots held by requests (not counting evictable prefixes)"
        )
        self.kv_total = self._gauge("kv_total_tokens", "KV cache slots")
        self.kv_usage = self._gauge("kv_usage_ratio", "KV slots in use / all")
        self.preemptions = self._gauge(
            "num_preemptions",
            "requests retracted (preempted) to free KV slots, to be recomputed, so far",
        )
        self.forward_batches = self._gauge(
            "forward_batches",
            "forward passes so far, by phase and by path "
            "(graph = CUDA-graph replay, eager = fallback or graphs off)",
            "phase",
            "path",
        )
        self.padding_tokens = self._gauge(
            "graph_padding_tokens",
            "tokens computed only to pad a batch up to a captured graph shape, so far",
            "phase",
        )
        self.grammar_steps = self._gauge(
            "grammar_steps",
            "sampling steps that masked a structured-output request's logits, so far",
        )
        self.grammar_host_seconds = self._gauge(
            "grammar_host_seconds",
            "host time of the grammar engine (feeding tokens, filling bitmasks), so far",
        )
        self.prefix_prompt_tokens = self._gauge(
            "prefix_cache_prompt_tokens",
            "prompt tokens admitted to prefill (first admissions), so far",
        )
        self.prefix_hit_tokens = self._gauge(
            "prefix_cache_hit_tokens",
            "of those prompt tokens, found in the prefix cache (not computed), so far",
        )
        self.prefix_hit_ratio = self._gauge(
            "prefix_cache_hit_ratio", "prefix cache hit tokens / prompt tokens, so far"
        )
        self.prefix_cache_tokens = self._gauge(
            "prefix_cache_tokens", "KV slots the prefix cache holds"
        )
        self.spec_verify_steps = self._gauge(
            "spec_verify_steps", "speculative decoding: verify steps so far"
        )
        self.spec_draft_tokens = self._gauge(
            "spec_draft_tokens", "speculative decoding: draft tokens proposed so far"
        )
        self.spec_accepted_tokens = self._gauge(
            "spec_accepted_tokens", "speculative decoding: of them, accepted by the target"
        )
        self.spec_accept_length = self._gauge(
            "spec_accept_length",
            "speculative decoding: request verifications (with drafts) so far, by tokens gained "
            "(drafts accepted plus the target's own)",
            "tokens",
        )
        self.spec_position_acceptance = self._gauge(
            "spec_position_acceptance_ratio",
            "speculative decoding: drafts accepted / proposed at each position of a chain",
            "position",
        )
        self.spec_draft_seconds = self._gauge(
            "spec_draft_seconds", "speculative decoding: time spent drafting, so far"
        )
        self.spec_verify_seconds = self._gauge(
            "spec_verify_seconds", "speculative decoding: time spent in verify steps, so far"
        )
        self.moe_expert_tokens = self._gauge(
            "moe_expert_tokens",
            "mixture-of-experts models: tokens routed to each expert so far, summed over the "
            "MoE layers (once per layer that routes a token to it)",
            "expert",
        )
        self.moe_rank_tokens = self._gauge(
            "moe_rank_tokens",
            "expert parallelism: tokens routed to the experts each rank holds, so far",
            "rank",
        )
        self._expert_tokens = ExpertTokens([])  # the last set, to skip unchanged ones
        self.ttft = self._seconds("time_to_first_token_seconds", "time to first token")
        self.itl = BatchHistogram(
            "replaylm_inter_token_latency_seconds", "time between tokens", _LATENCY_BUCKETS, r
        )
        self.e2e = self._seconds(
            "e2e_request_latency_seconds", "time from arrival to the request's end"
        )
        self.queue_time = self._seconds(
            "request_queue_time_seconds", "time from arrival to first admission to a prefill"
        )
        self.prefill_time = self._seconds(
            "request_prefill_time_seconds", "time from first admission to the first token"
        )
        self.decode_time = self._seconds(
            "request_decode_time_seconds", "time from the first token to the request's end"
        )
        self.request_prompt_tokens = Histogram(
            "replaylm_request_prompt_tokens",
            "prompt tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "replaylm_request_generation_tokens",
            "generated tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        # what a scrape reads: this registry, or every front end's files in multiprocess mode
        self.source: Collector = r
        if values.ValueClass is not values.MutexValue:  # multiprocess mode (launch_server)
            self.source = MultiProcessCollector(None)
        self.vllm = VllmNames(self.source, vllm_model_name) if vllm_model_name else None

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        """A gauge of the scheduler's: every front end sets it from the stats it receives, and
        in multiprocess mode the latest setting is served."""
        return Gauge(
            f"replaylm_{name}",
            doc,
            list(labels),
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )

    def _seconds(self, name: str, documentation: str) -> Histogram:
        return Histogram(
            f"replaylm_{name}", documentation, buckets=_LATENCY_BUCKETS, registry=self.registry
        )

    def first_token(self, ttft: float, arrived_wall: float, admitted_wall: float | None) -> None:
        """A request's first token: its TTFT, split at its admission into queue and prefill time.
        The admission is stamped in the scheduler process, so both halves use the wall clock."""
        self.ttft.observe(ttft)
        if admitted_wall is not None:
            self.queue_time.observe(max(admitted_wall - arrived_wall, 0.0))
            self.prefill_time.observe(max(time.time() - admitted_wall, 0.0))

    def request_ended(
        self,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e: float,
        decode: float | None,
    ) -> None:
        """A request's end, finished or aborted; `decode` is None when it had no token."""
        self.requests.labels(finish_reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.e2e.observe(e2e)
        if decode is not None:
            self.decode_time.observe(decode)

    def set_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_used_tokens)
        self.kv_total.set(stats.kv_total_tokens)
        self.kv_usage.set(stats.kv_used_tokens / max(stats.kv_total_tokens, 1))
        self.preemptions.set(stats.num_retractions)
        self.grammar_steps.set(stats.grammar_steps)
        self.grammar_host_seconds.set(stats.grammar_host_s)
        self.prefix_prompt_tokens.set(stats.prefix_prompt_tokens)
        self.prefix_hit_tokens.set(stats.prefix_cached_tokens)
        self.prefix_hit_ratio.set(stats.prefix_cached_tokens / max(stats.prefix_prompt_tokens, 1))
        self.prefix_cache_tokens.set(stats.prefix_cache_tokens)
        if stats.speculation is not None:
            self._set_speculation(stats.speculation)
        if stats.expert_tokens is not None and stats.expert_tokens != self._expert_tokens:
            self._set_expert_tokens(stats.expert_tokens)
        for phase, counts in stats.forward_stats.phases.items():
            self.forward_batches.labels(phase, "graph").set(counts.graph)
            self.forward_batches.labels(phase, "eager").set(counts.eager)
            self.padding_tokens.labels(phase).set(counts.padding_tokens)

    def _set_speculation(self, spec: SpeculationStats) -> None:
        self.spec_verify_steps.set(spec.verify_steps)
        self.spec_draft_tokens.set(spec.drafted)
        self.spec_accepted_tokens.set(spec.accepted)
        for accepted, count in enumerate(spec.accept_lengths):
            self.spec_accept_length.labels(str(accepted + 1)).set(count)
        for position, (proposed, accepted) in enumerate(
            zip(spec.proposed_at, spec.accepted_at + [0] * len(spec.proposed_at), strict=False)
        ):
            self.spec_position_acceptance.labels(str(position + 1)).set(accepted / proposed)
        self.spec_draft_seconds.set(spec.draft_seconds)
        self.spec_verify_seconds.set(spec.verify_seconds)

    def _set_expert_tokens(self, tokens: ExpertTokens) -> None:
        """One series per expert (and per rank under expert parallelism), set only when the
        totals changed: the scheduler refreshes them far less often than it sends stats."""
        for expert, count in enumerate(tokens.experts):
            self.moe_expert_tokens.labels(str(expert)).set(count)
        for rank, count in enumerate(tokens.ranks or ()):
            self.moe_rank_tokens.labels(str(rank)).set(count)
        self._expert_tokens = tokens

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        text = generate_latest(self.source)  # any collector does
        if self.vllm is not None:
            text += generate_latest(self.vllm)
        return text, CONTENT_TYPE_LATEST


# replaylm's label names that vLLM spells otherwise
_VLLM_LABELS = {"finish_reason": "finished_reason"}


# replaylm's series with a vLLM (v0.12) equivalent: {family: (vLLM's name, vLLM's type where it
# differs: a gauge of a running total that vLLM counts)}
_VLLM_NAMES: dict[str, tuple[str, str | None]] = {
    "replaylm_num_running_requests": ("vllm:num_requests_running", None),
    "replaylm_num_waiting_requests": ("vllm:num_requests_waiting", None),
    "replaylm_kv_usage_ratio": ("vllm:kv_cache_usage_perc", None),
    "replaylm_prefix_cache_prompt_tokens": ("vllm:prefix_cache_queries", "counter"),
    "replaylm_prefix_cache_hit_tokens": ("vllm:prefix_cache_hits", "counter"),
    "replaylm_num_preemptions": ("vllm:num_preemptions", "counter"),
    "replaylm_prompt_tokens": ("vllm:prompt_tokens", None),
    "replaylm_generation_tokens": ("vllm:generation_tokens", None),
    "replaylm_requests": ("vllm:request_success", None),
    "replaylm_request_prompt_tokens": ("vllm:request_prompt_tokens", None),
    "replaylm_request_generation_tokens": ("vllm:request_generation_tokens", None),
    "replaylm_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", None),
    "replaylm_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", None),
    "replaylm_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", None),
    "replaylm_request_queue_time_seconds": ("vllm:request_queue_time_seconds", None),
    "replaylm_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds", None),
    "replaylm_request_decode_time_seconds": ("vllm:request_decode_time_seconds", None),
    "replaylm_spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "counter"),
    "replaylm_spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "counter"),
}
# replaylm's label names that vLLM spells otherwise
_VLLM_LABELS = {"finish_reason": "finished_reason"}


class VllmNames(Collector):
    """The series that have a vLLM equivalent, under vLLM's (v0.12) names and labels, for
    dashboards and autoscalers written for vLLM. Renamed at scrape time from what `source`
    collects: observing costs nothing more, only a scrape does."""

    def __init__(self, source: Collector, model_name: str) -> None:
        self.source = source
        self.labels = {"model_name": model_name, "engine": "0"}  # vLLM's engine: its DP rank

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name not in _VLLM_NAMES:
                continue
            name, typ = _VLLM_NAMES[family.name]
            renamed = Metric(name, family.documentation, typ or family.type)
            as_counter = renamed.type != family.type  # a gauge's value, as `name_total`
            renamed.samples = [
                sample._replace(
                    name=name + ("_total" if as_counter else sample.name[len(family.name) :]),
                    labels=self.labels
                    | {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()},
                )
                for sample in family.samples
            ]
            yield renamed
