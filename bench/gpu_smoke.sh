#!/usr/bin/env bash
# GPU smoke benchmark of the ImageNet pipeline, every scheme, bf16; about 5-7 minutes on one modern GPU.
# Usage: bash bench/gpu_smoke.sh [--steps 200] [--batch 128] [--schemes rope_axial rope_mixed]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
timeout 480 .venv/bin/python bench/gpu_smoke.py "$@"
