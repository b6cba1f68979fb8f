#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite on both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# both cores (pytest-xdist; one process per core): the suite takes about twice as long in one process.
# Arguments come after, so e.g. `-n 0` runs in one process and `-x` stops at the first failure.
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
