#!/usr/bin/env bash
# GPU checks (bf16 against fp32 per scheme, patch dropout, iRPE's value term at 1024 px; about a minute), then the
# smoke benchmark of the ImageNet pipeline, every scheme, bf16; about 5-7 minutes on one modern GPU.
# Usage: bash bench/gpu_smoke.sh [--steps 200] [--batch 128] [--schemes rope_axial rope_mixed]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
timeout 90 .venv/bin/python bench/gpu_checks.py || status=$?  # the benchmark still runs; its status is kept
timeout 480 .venv/bin/python bench/gpu_smoke.py "$@"
exit "$status"
