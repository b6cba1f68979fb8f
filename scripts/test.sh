#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite on both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# both cores (pytest-xdist; one process per core): the suite takes about twice as long in one process.
# Arguments come after, so e.g. `-x` stops at the first failure; PYTEST_WORKERS=0 runs in one process (with every
# core for torch).
# One torch thread per worker (tests/conftest.py sets the same inside each worker): torch's default of every core in
# every worker oversubscribes the machine and made the suite about twice as slow.
workers="${PYTEST_WORKERS:-2}"
if [ "$workers" != "0" ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
.venv/bin/python -m pytest -n "$workers" "$@"
