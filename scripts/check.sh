#!/usr/bin/env bash
# Every check CI runs, in order: lint, format, types, then the test suite. Extra arguments go to
# pytest. Usage: bash scripts/check.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check python test benchmark scripts
ruff format --check python test benchmark scripts
mypy
# Two workers, each taking whole test files (module-scoped servers stay with their file); one
# OpenMP thread per process, or the workers and their servers' spinning threads fight for the cores.
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python -m pytest test -q -n 2 --dist loadfile "$@"
