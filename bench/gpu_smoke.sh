#!/usr/bin/env bash
# GPU checks (bf16 against fp32 per scheme, patch dropout, iRPE's value term at 1024 px; about a minute), then the
# training-step benchmark with profiles (bench/throughput.py, synthetic images), then the smoke benchmark of the
# ImageNet pipeline, every scheme, bf16; about 9 minutes in all on one H200 (2026-12-04: data loading holds each
# scheme to about 430 images/s in the pipeline, 20 s per scheme at 60 steps).
# Usage: bash bench/gpu_smoke.sh [--out DIR] [--dry-run] [--steps 60] [--batch 128] [--schemes rope_axial rope_mixed]
#   --out DIR   folder of the result files: gpu_checks.{md,csv} and throughput.{md,csv} (bench/results.py), the
#               smoke benchmark's own files if bench/gpu_smoke.py takes --out, and each step's printed log
#               (default runs/gpu_results, which git ignores; copy the files into docs/benchmarks/results/ by hand)
#   --dry-run   on CPU, one scheme at 32 px: the checks and the training-step benchmark run and write their files;
#               the smoke benchmark only parses its options (its 20 warm-up steps need a GPU to be quick)
#   --scenes    instead of the above, the GPU configuration of the scenes benchmark (configs/scenes/scenes_gpu.yaml,
#               a ViT-S at 64 -> 256 px, 3,000 steps): NoPE, learned, RoPE-Axial and RoPE-Mixed on region, seed 0,
#               about 2 minutes per model on one H100; its files are scenes_gpu.{md,csv,png} in --out. The whole
#               sweep: python train/scenes.py --config configs/scenes/scenes_gpu.yaml --out runs/scenes_gpu
# Other options go to bench/gpu_smoke.py.
# On a machine that cannot reach the package registries but has PyTorch, timm and Lightning (a lent GPU box):
#   PYTHON=python3 bash bench/gpu_smoke.sh --out "$OUT"   # no set-up; visionpe is imported from this checkout
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/gpu_results
dry=0
scenes=0
smoke_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        --out=*) out=${1#--out=}; shift ;;
        --dry-run) dry=1; shift ;;
        --scenes) scenes=1; shift ;;
        *) smoke_args+=("$1"); shift ;;
    esac
done
if [ -n "${PYTHON:-}" ]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    bash scripts/setup.sh
    PYTHON=.venv/bin/python
fi
mkdir -p "$out"
if [ "$scenes" = 1 ]; then
    scenes_args=(--schemes none learned rope_axial rope_mixed --references --tasks region --seeds 0
                 --extrapolation none pi ntk --out "$out/scenes_gpu" --reuse --results "$out" --results-name scenes_gpu)
    if [ "$dry" = 1 ]; then
        # on CPU: the quick check of the pipeline with the GPU configuration's data and sizes
        scenes_args+=(--quick)
    fi
    status=0
    timeout 560 "$PYTHON" train/scenes.py --config configs/scenes/scenes_gpu.yaml "${scenes_args[@]}" 2>&1 \
        | tee "$out/scenes_gpu.log" || status=$?
    echo "result files in $out:" && ls "$out"
    exit "$status"
fi
if grep -q -- '"--out"' bench/gpu_smoke.py; then
    smoke_args+=(--out "$out")
fi
if [ "$dry" = 1 ]; then
    checks=(--device cpu --schemes rope_axial --size 32 --value-size 32 --memory-size 32)
    step=(--device cpu --schemes rope_axial --precision bf16 --batch 1 --size 32 --steps 2 --rounds 1 --warmup 0)
else
    checks=()
    # --flex: the bias schemes of the speed targets also on FlexAttention (rows "<scheme> (flex)")
    step=(--device cuda --precision bf16 --batch 128 --steps 5 --rounds 5 --flex alibi2d lookhere irpe)
fi
status=0
# the benchmarks still run when a check fails; its status is kept
timeout 150 "$PYTHON" bench/gpu_checks.py ${checks[@]+"${checks[@]}"} --out "$out" 2>&1 | tee "$out/gpu_checks.log" \
    || status=$?
# the training step alone (synthetic images), with kernels and GPU time per step; about a minute and a half, plus
# FlexAttention's compilation for the flex rows
timeout 300 "$PYTHON" bench/throughput.py "${step[@]}" --profile --out "$out" 2>&1 | tee "$out/throughput.log" \
    || status=$?
if [ "$dry" = 1 ]; then
    "$PYTHON" bench/gpu_smoke.py --help > /dev/null
    echo "dry run: bench/gpu_smoke.py parses its options; not run on CPU"
else
    timeout 480 "$PYTHON" bench/gpu_smoke.py ${smoke_args[@]+"${smoke_args[@]}"} 2>&1 | tee "$out/gpu_smoke.log"
fi
echo "result files in $out:" && ls "$out"
exit "$status"
