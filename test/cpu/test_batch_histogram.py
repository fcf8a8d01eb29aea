"""The batch-observed histogram of the per-token series exposes what prometheus_client's own
Histogram would for the same observations, bucket edges included."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from replaylm.runtime.metrics import BatchHistogram

BUCKETS = (0.005, 0.01, 0.1, 1, 2.5)  # an int bound renders as prometheus_client's


def test_batch_histogram_renders_as_a_prometheus_histogram():
    values = [0.001, 0.005, 0.0051, 0.01, 0.5, 1.0, 3.0, 0.05]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = BatchHistogram("x_seconds", "doc", BUCKETS, ours)
    batched.observe_many(values[:3])
    batched.observe_many([])
    batched.observe_many(values[3:])
    reference = Histogram("x_seconds", "doc", buckets=BUCKETS, registry=theirs)
    for value in values:
        reference.observe(value)
    rendered = generate_latest(ours).decode()
    expected = generate_latest(theirs).decode()
    # the same lines, but the sum: a batch is summed before it is added
    assert without_sum(rendered) == without_sum(expected)
    assert sum_of(rendered) == pytest.approx(sum(values), rel=1e-12) == sum_of(expected)
    assert 'x_seconds_bucket{le="0.005"} 2.0' in rendered
    assert 'x_seconds_bucket{le="1.0"} 7.0' in rendered
    assert 'x_seconds_bucket{le="+Inf"} 8.0' in rendered and "x_seconds_count 8.0" in rendered


def without_sum(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("x_seconds_sum")]


def sum_of(text: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith("x_seconds_sum")]
    return float(line.split()[1])
