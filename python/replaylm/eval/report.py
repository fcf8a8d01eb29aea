"""The run's outputs: a short table on stdout, the metrics as JSON, every record as JSON lines."""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

from replaylm.eval.metrics import Metrics
from replaylm.eval.runner import Record


def format_table(config: dict[str, Any], m: Metrics) -> str:
    lo, hi = m.accuracy_ci95
    rows = [
        ("eval", config["eval_name"]),
        ("model", config["model"]),
        ("questions", str(m.num_examples)),
        ("accuracy", f"{m.accuracy:.3f} ({m.correct}/{m.num_examples}; 95% CI {lo:.3f}-{hi:.3f})"),
        ("invalid", f"{m.invalid_rate:.3f} ({m.invalid}; {m.errors} request errors)"),
        ("latency", f"{m.latency_s:.1f} s"),
        ("throughput", f"{m.output_throughput:.1f} output tok/s ({m.output_tokens} tokens)"),
    ]
    return "\n".join(f"{name:<11} {value}" for name, value in rows)


def write_json(path: str, config: dict[str, Any], m: Metrics) -> None:
    """{"config": the run's settings, "metrics": Metrics fields}."""
    doc = {"config": config, "metrics": dataclasses.asdict(m)}
    Path(path).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_dump(path: str, records: list[Record]) -> None:
    """One JSON object per question, in question order; numbers (parsed, reference) as strings."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dataclasses.asdict(r), ensure_ascii=False, default=_decimal) + "\n")


def _decimal(value: object) -> str:
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
