"""Print the GPU check's summary table from the files scripts/gpu_check.sh left in OUT.

    python scripts/summarize_gpu_check.py OUT

One row per test file (passed / failed / skipped, seconds) from the JUnit XML, then the `summary`
rows of every benchmark JSON under OUT/results/<gpu>/ (`{"summary": [{"name": ..., ...}, ...]}`).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def test_rows(junit: Path) -> list[tuple[str, int, int, int, float]]:
    counts: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
    for case in ET.parse(junit).iter("testcase"):
        row = counts[case.get("classname", "?").rsplit(".", 1)[-1]]
        if case.find("skipped") is not None:
            row[2] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            row[1] += 1
        else:
            row[0] += 1
        row[3] += float(case.get("time", 0))
    return [(name, int(p), int(f), int(s), t) for name, (p, f, s, t) in sorted(counts.items())]


def main(out: Path) -> None:
    gpu = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else "?"
    print(f"\n=== GPU check summary ({gpu.splitlines()[0] if gpu else '?'}) ===")
    junit = out / "gpu_tests.xml"
    if junit.exists():
        print(f"{'test file':44} {'pass':>5} {'fail':>5} {'skip':>5} {'secs':>7}")
        for name, p, f, s, t in test_rows(junit):
            print(f"{name:44} {p:5d} {f:5d} {s:5d} {t:7.1f}")
    else:
        print("no test results (pytest did not run)")
    for path in sorted(out.glob("results/*/*.json")):
        rows = json.loads(path.read_text()).get("summary", [])
        print(f"\n{path.stem}")
        for row in rows:
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
