"""Server start to first token, per CUDA-graph mode, cold and with a warm compile cache.

    python benchmark/bench_startup.py [--model-path benchmark/configs/qwen3-0.6b.json]
        [--load-format dummy] [--modes JSON ...] [--device cuda] [--json out.json]

For each `--cuda-graph-mode` JSON a `launch_server` process is started and POST /generate (one
token for a fixed 16-token prompt) is retried until it answers: the time from spawning the
process to that answer is the start time (loading, KV allocation, compiling, capturing, first
forward). Every mode runs once with an empty `--compile-cache-dir` ("cold"); modes that compile
(tc_piecewise) run a second time on the same directory ("warm"). The table also gives each start
as a fraction of the cold tc_piecewise start, and where each start's time went: the seconds from
the spawn to each milestone the server logs (`PHASES`: arguments resolved for the device, which
the HTTP process does after it spawns the scheduler; model loaded; compiled; CUDA graphs
captured; serving), read from the log's timestamps.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

from common import config_path, free_port, write_json

MODES = [
    '{"decode": "disabled", "prefill": "disabled"}',
    '{"decode": "full", "prefill": "breakable"}',
    '{"decode": "breakable", "prefill": "breakable"}',
    '{"decode": "tc_piecewise", "prefill": "tc_piecewise"}',
]
PROMPT = list(range(100, 116))
TIMEOUT_S = 600.0
# milestone -> what its log line says (the last such line counts: capture logs once per phase)
PHASES = {
    "args": "replaylm.launch_server: server args",
    "loaded": "replaylm.model_loader.loader: loaded",
    "compiled": "tc_piecewise: compiled the forward",
    "captured": "CUDA graphs (",
    "serving": "replaylm.launch_server: serving",
}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def phases(log: str, spawned: float) -> dict[str, float]:
    """Seconds from `spawned` (epoch seconds) to each PHASES milestone found in a server `log`
    (lines stamped by logging's default asctime, local time)."""
    found = {}
    for line in log.splitlines():
        stamp = _STAMP.match(line)
        if not stamp:
            continue
        at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for name, marker in PHASES.items():
            if marker in line:
                found[name] = round(at - spawned, 2)
    return {name: found[name] for name in PHASES if name in found}


def time_to_first_token(server_args: list[str], log: Path) -> tuple[float, float]:
    """(seconds from spawning `launch_server server_args` to its first generated token, the
    spawn's epoch time); the server is stopped afterwards. Raises RuntimeError (with the log's
    tail) if it dies."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "replaylm.launch_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *server_args,
    ]
    url = f"http://127.0.0.1:{port}/generate"
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    with log.open("w") as out:
        spawned, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            while time.perf_counter() - start < TIMEOUT_S:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                    )
                try:
                    if httpx.post(url, json=body, timeout=TIMEOUT_S).status_code == 200:
                        return time.perf_counter() - start, spawned
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            raise RuntimeError(
                f"no first token after {TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}"
            )
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=str(config_path("qwen3-0.6b")))
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep each server's log here (default: a temporary directory)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_startup_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, modes in enumerate(args.modes):
        cache = Path(tempfile.mkdtemp(prefix="compile_cache_"))
        starts = ["cold", "warm"] if "tc_piecewise" in modes else ["cold"]
        for start in starts:
            server_args = [
                "--model-path",
                args.model_path,
                "--load-format",
                args.load_format,
                "--device",
                args.device,
                "--cuda-graph-mode",
                modes,
                "--compile-cache-dir",
                str(cache),
            ]
            log = log_dir / f"server_{i}_{start}.log"
            seconds, spawned = time_to_first_token(server_args, log)
            rows.append(
                {
                    "modes": json.loads(modes),
                    "start": start,
                    "seconds": seconds,
                    "phases": phases(log.read_text(), spawned),
                }
            )
            print(f"{modes} {start}: {seconds:.1f} s", flush=True)

    tc_cold = next(
        (
            r["seconds"]
            for r in rows
            if r["start"] == "cold" and "tc_piecewise" in r["modes"].values()
        ),
        None,
    )
    print(f"\n{'decode':14} {'prefill':14} {'start':6} {'seconds':>8} {'of tc cold':>11}")
    for r in rows:
        share = f"{r['seconds'] / tc_cold:10.0%}" if tc_cold else f"{'':>10}"
        r["of_tc_piecewise_cold"] = r["seconds"] / tc_cold if tc_cold else None
        print(
            f"{r['modes']['decode']:14} {r['modes']['prefill']:14} {r['start']:6} "
            f"{r['seconds']:8.1f} {share}"
        )
    print(f"\nseconds from the spawn to each milestone: {', '.join(PHASES)}, first token")
    for r in rows:
        marks = "  ".join(
            f"{name} {r['phases'][name]:5.1f}" if name in r["phases"] else f"{name}   -  "
            for name in PHASES
        )
        print(
            f"{r['modes']['decode']:14} {r['modes']['prefill']:14} {r['start']:6} {marks}  "
            f"first token {r['seconds']:5.1f}"
        )
    if args.json:
        summary = [
            {
                "decode": r["modes"]["decode"],
                "prefill": r["modes"]["prefill"],
                "start": r["start"],
                "seconds": round(r["seconds"], 1),
            }
            for r in rows
        ]
        write_json(args.json, {"model_path": args.model_path, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
