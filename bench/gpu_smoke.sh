#!/usr/bin/env bash
# GPU checks (bf16 against fp32 per scheme, patch dropout, iRPE's value term at 1024 px; about a minute), then the
# smoke benchmark of the ImageNet pipeline, every scheme, bf16; about 7 minutes in all on one H200 (2026-12-04:
# data loading holds each scheme to about 430 images/s, 20 s per scheme at 60 steps).
# Usage: bash bench/gpu_smoke.sh [--steps 60] [--batch 128] [--schemes rope_axial rope_mixed]
# On a machine that cannot reach the package registries but has PyTorch, timm and Lightning (a lent GPU box):
#   PYTHON=python3 bash bench/gpu_smoke.sh   # no set-up; visionpe is imported from this checkout
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    bash scripts/setup.sh
    PYTHON=.venv/bin/python
fi
status=0
timeout 150 "$PYTHON" bench/gpu_checks.py || status=$?  # the benchmark still runs; its status is kept
timeout 480 "$PYTHON" bench/gpu_smoke.py "$@"
exit "$status"
