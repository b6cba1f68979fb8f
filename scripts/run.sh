#!/usr/bin/env bash
# The main job: sets up .venv if needed, then the scenes benchmark in its main setting (train/scenes.py,
# configs/scenes/scenes.yaml): NoPE, learned APE, CPE, RoPE-Axial, RoPE-Mixed and LookHere, each trained on the two
# position tasks (region: which quadrant holds the target; relative: where one object lies from another) from
# fresh procedural scenes at 32 px, then tested on 2,000 held-out scenes at 1x and 2x the side, zoomed (the same
# scene with more pixels) and on a larger canvas (more objects, longer distances), rotary schemes also with
# position interpolation. One row per published claim it can check: RoPE-Mixed against RoPE-Axial and APE
# (Heo et al. 2024), CPE's convolution against APE (Chu et al. 2023), LookHere's directed heads (Fuller et al.
# 2024); NoPE is the control (exactly 25 % on region). Two runs at a time, one per core. It prints one line per
# model (training time, accuracy at the training size), then the tables and where the files went: tables, CSV, plot
# and checkpoints in runs/main (or --out). Extra arguments go to train/scenes.py and win over the defaults here
# (e.g. `--seeds 0 1 2`, `--tasks region relative count`, `--results docs/benchmarks/results --results-name
# scenes_main`, which rewrites the documented table). The digits benchmark, the real-data protocol, is
# scripts/digits.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python train/scenes.py --config configs/scenes/scenes.yaml \
    --schemes none learned cpe rope_axial rope_mixed lookhere --references \
    --tasks region relative --kinds zoom canvas --scales 1 2 --seeds 0 --extrapolation none pi \
    --jobs 2 --out runs/main "$@"
