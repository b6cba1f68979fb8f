#!/usr/bin/env bash
# The main job. Sets up .venv if needed, then measures the training throughput of every position scheme
# against timm's ViT-S/16 (the training and extrapolation sweep will take this place once it lands).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python bench/throughput.py "$@"
