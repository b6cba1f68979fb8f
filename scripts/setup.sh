#!/usr/bin/env bash
# Creates .venv on a fresh clone and installs visionpe with every extra (training, Hugging Face, open_clip, tests,
# docs); reuses a complete .venv (the stamp holds a hash of pyproject.toml and this script).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp_src=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
stamp=.venv/.visionpe-setup
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_src" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The exact torch pair first: a looser pin pulls a newer multi-GB build.
.venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
# visionpe with every extra the test suite and the docs build need: train, vlm, clip (= all), dev, docs
.venv/bin/python -m pip install -q -e ".[all,dev,docs]"
echo "$stamp_src" > "$stamp"
