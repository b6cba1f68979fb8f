#!/usr/bin/env bash
# GPU checks (bf16 against fp32 per scheme, patch dropout, iRPE's value term at 1024 px; about a minute), then the
# training-step benchmark with profiles (bench/throughput.py, synthetic images), then the smoke benchmark of the
# ImageNet pipeline, every scheme, bf16; about 9 minutes in all on one H200 (2026-12-04: data loading holds each
# scheme to about 430 images/s in the pipeline, 20 s per scheme at 60 steps).
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
timeout 150 "$PYTHON" bench/gpu_checks.py || status=$?  # the benchmarks still run; its status is kept
# the training step alone (synthetic images), with kernels and GPU time per step; about a minute and a half
timeout 180 "$PYTHON" bench/throughput.py --device cuda --precision bf16 --batch 128 --steps 5 --rounds 5 --profile \
    || status=$?
timeout 480 "$PYTHON" bench/gpu_smoke.py "$@"
exit "$status"
