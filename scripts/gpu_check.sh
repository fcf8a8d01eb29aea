#!/usr/bin/env bash
# The GPU check: run test/gpu and the benchmarks on a CUDA machine, log everything under $OUT,
# and print a short summary table last.
#
#   bash scripts/gpu_check.sh [pytest args...]
#
# Wheels for packages the GPU host lacks travel in .whl/ (../shared/tools/device-wheels ...).
# The built-in model's GGUF (98 MB) travels split (../shared/tools/device-stage); the joined
# file is looked for at /root/SmolLM2-135M-Instruct.Q4_1.gguf (override: REPLAYLM_SMOLLM2_GGUF).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/.gpu/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/python:$PWD/test:${PYTHONPATH:-}"
gguf_default=/root/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -z "${REPLAYLM_SMOLLM2_GGUF:-}" ] && [ -f "$gguf_default" ]; then
    export REPLAYLM_SMOLLM2_GGUF="$gguf_default"
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"

python3 -m pytest test/gpu -v -rs --durations=10 --junitxml="$OUT/gpu_tests.xml" "$@" \
    2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

bench_rc=0
for bench in benchmark/bench_*.py; do
    [ -e "$bench" ] || continue
    name=$(basename "$bench" .py)
    python3 "$bench" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" || bench_rc=1
done

python3 scripts/summarize_gpu_check.py "$OUT"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
