"""Prometheus metrics of the server (`GET /metrics`), kept in the main process.

Request, token and latency series are observed by the tokenizer manager as outputs arrive; the
scheduler's gauges (queue, running, KV usage) are refreshed from the stats it sends every step.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from replaylm.runtime.io_struct import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """One registry per server, so several servers (tests) never share series."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "replaylm_requests", "finished requests", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("replaylm_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "replaylm_generation_tokens", "generated tokens", registry=r
        )
        self.running = Gauge("replaylm_num_running_requests", "requests decoding", registry=r)
        self.waiting = Gauge("replaylm_num_waiting_requests", "requests queued", registry=r)
        self.kv_used = Gauge("replaylm_kv_used_tokens", "KV cache slots in use", registry=r)
        self.kv_total = Gauge("replaylm_kv_total_tokens", "KV cache slots", registry=r)
        self.kv_usage = Gauge("replaylm_kv_usage_ratio", "KV slots in use / all", registry=r)
        self.retractions = Gauge("replaylm_retractions", "requests retracted so far", registry=r)
        self.forward_batches = Gauge(
            "replaylm_forward_batches",
            "forward passes so far, by phase and by path "
            "(graph = CUDA-graph replay, eager = fallback or graphs off)",
            ["phase", "path"],
            registry=r,
        )
        self.padding_tokens = Gauge(
            "replaylm_graph_padding_tokens",
            "tokens computed only to pad a batch up to a captured graph shape, so far",
            ["phase"],
            registry=r,
        )
        self.grammar_steps = Gauge(
            "replaylm_grammar_steps",
            "sampling steps that masked a structured-output request's logits, so far",
            registry=r,
        )
        self.grammar_host_seconds = Gauge(
            "replaylm_grammar_host_seconds",
            "host time of the grammar engine (feeding tokens, filling bitmasks), so far",
            registry=r,
        )
        self.ttft = Histogram(
            "replaylm_time_to_first_token_seconds",
            "time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "replaylm_inter_token_latency_seconds",
            "time between tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "replaylm_e2e_request_latency_seconds",
            "request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def set_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_used_tokens)
        self.kv_total.set(stats.kv_total_tokens)
        self.kv_usage.set(stats.kv_used_tokens / max(stats.kv_total_tokens, 1))
        self.retractions.set(stats.num_retractions)
        self.grammar_steps.set(stats.grammar_steps)
        self.grammar_host_seconds.set(stats.grammar_host_s)
        for phase, counts in stats.forward_stats.phases.items():
            self.forward_batches.labels(phase, "graph").set(counts.graph)
            self.forward_batches.labels(phase, "eager").set(counts.eager)
            self.padding_tokens.labels(phase).set(counts.padding_tokens)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
