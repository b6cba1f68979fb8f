#!/usr/bin/env bash
# The main job: sets up .venv if needed, trains every main scheme and timm's own reference ViTs on the bundled
# digits (configs/demo/digits.yaml), then sweeps them over 32-128 px and prints the table; the table, CSV, plot and
# checkpoints land in runs/main (or --out). Extra arguments go to train/extrapolate.py, e.g. `--seeds 0 1 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python train/extrapolate.py --config configs/demo/digits.yaml \
    --schemes learned rope_axial rope_mixed cpe irpe string_cayley \
    --references timm_ape timm_rope_axial timm_rope_mixed \
    --extrapolation none pi --out runs/main "$@"
