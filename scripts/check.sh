#!/usr/bin/env bash
# Every check CI runs, in order: lint, format, types, then the test suite. Extra arguments go to
# pytest. Usage: bash scripts/check.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check python test benchmark scripts
ruff format --check python test benchmark scripts
mypy
python -m pytest test -q "$@"
