#!/usr/bin/env bash
# The GPU measurements, in parts that each fit in one 10-minute call (on one H100/H200):
#   steps   bench/gpu_checks.py (bf16 against fp32 per scheme, patch dropout, iRPE's value term at 1024 px; about a
#           minute), then the training step on synthetic images (bench/throughput.py, bf16, batch 128, with kernels
#           and GPU time per step), with the bias schemes also on FlexAttention and the cos/sin rotary schemes also
#           with the fused compiled rotation; about 5 minutes
#   smoke   the ImageNet pipeline (bench/gpu_smoke.py), every scheme, bf16, 60 steps each; about 7 minutes
#           (2026-12-04, H200: data loading held each scheme to about 430 images/s, 20 s per scheme)
#   data    the training loop reading JPEG files through the GPU data pipeline (nvJPEG, kornia) and the CPU one,
#           against synthetic in-memory data (bench/data_pipeline.py), and a check that the batched augmentation
#           never synchronises with the device; about 4 minutes
#   scenes  a part of the scenes benchmark's GPU configuration (configs/scenes/scenes_gpu.yaml, a ViT-S at
#           64 -> 256 px, 3,000 steps): NoPE, learned, RoPE-Axial and RoPE-Mixed on region, seed 0, about 2
#           minutes per model; the whole sweep: python train/scenes.py --config configs/scenes/scenes_gpu.yaml
#   fsdp    the FSDP tests (tests/training/test_fsdp.py) with the GPU ones: bf16 blocks on one or two GPUs; about
#           3 minutes
#   fsdp2   FSDP2 (fully_shard per block, bench/fsdp2_check.py): a ViT built on the meta device, sharded over the
#           GPUs (torchrun: 2 processes with 2 GPUs or more, 1 with one), trains to the weights of one process, and
#           under a bf16 policy its position parameters and rotary tables stay fp32; then sequence parallelism
#           (bench/sequence_parallel.py, NCCL): a ViT-S at 496 x 464 px (900 tokens: 4 zig-zag chunks) sharded over
#           the tokens, Ulysses and ring attention, contiguous and zig-zag, equals the unsharded model (2 processes
#           with 2 GPUs, 1 with one); about 2 minutes
#   compile whole-model torch.compile with CUDA graphs (mode reduce-overhead) and max-autotune, bf16 training
#           steps against eager, for the schemes of the speed targets (bench/compile_modes.py); about 8 minutes
# Usage: bash bench/gpu_smoke.sh [--part steps] [--part smoke ...] [--out DIR] [--dry-run] [options of gpu_smoke.py]
#   --part P    run part P (repeatable; default: steps and smoke, about 12 minutes, as two calls on a lent machine)
#   --out DIR   folder of the result files (bench/results.py: gpu_checks, throughput, data_pipeline, scenes_gpu
#               .md/.csv) and each part's printed log (default runs/gpu_results, which git ignores; copy the files
#               into docs/benchmarks/results/ by hand: their names are those of the CPU tables there, so DIR is
#               never that folder, and is refused there)
#   --dry-run   on CPU, tiny sizes: each part runs its command far enough to check it (the smoke benchmark only
#               parses its options; scenes runs the benchmark's --quick check with the GPU configuration); a
#               pipeline check, not a measurement, which it says in one line at the end
# Other options go to bench/gpu_smoke.py (e.g. --steps 60 --batch 128 --schemes rope_axial rope_mixed).
# On a machine that cannot reach the package registries but has PyTorch, timm, Lightning and kornia (a lent GPU box):
#   PYTHON=python3 bash bench/gpu_smoke.sh --part steps --out "$OUT"   # no set-up; visionpe from this checkout
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/gpu_results
dry=0
parts=()
smoke_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        --out=*) out=${1#--out=}; shift ;;
        --part) parts+=("$2"); shift 2 ;;
        --part=*) parts+=("${1#--part=}"); shift ;;
        --dry-run) dry=1; shift ;;
        *) smoke_args+=("$1"); shift ;;
    esac
done
[ ${#parts[@]} -gt 0 ] || parts=(steps smoke)
published=$(realpath -m docs/benchmarks/results)
case "$(realpath -m "$out")/" in
    "$published"/*)
        echo "--out $out is the published results folder (docs/benchmarks/results); give a folder under runs/" \
             "and copy the files you mean to publish by hand" >&2
        exit 2 ;;
esac
for part in "${parts[@]}"; do
    case "$part" in
        steps|smoke|data|scenes|fsdp|fsdp2|compile) ;;
        *) echo "--part must be one of steps smoke data scenes fsdp fsdp2 compile, got '$part'" >&2; exit 2 ;;
    esac
done
if [ -n "${PYTHON:-}" ]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    bash scripts/setup.sh
    PYTHON=.venv/bin/python
fi
mkdir -p "$out"
status=0  # every part runs even when an earlier one fails; the first failure's status is kept

run_part() {  # run_part NAME TIMEOUT COMMAND...: the command's output to the screen and to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    if [ "$code" != 0 ] && [ "$status" = 0 ]; then
        status=$code
    fi
}

fused=(rope_axial rope_mixed string_cayley string_circulant)
for part in "${parts[@]}"; do
    case "$part" in
    steps)
        if [ "$dry" = 1 ]; then
            checks=(--device cpu --schemes rope_axial --size 32 --value-size 32 --memory-size 32)
            step=(--device cpu --schemes rope_axial --precision bf16 --batch 1 --size 32 --steps 2 --rounds 1
                  --warmup 0 --fused-rotary rope_axial)
        else
            checks=()
            # the bias schemes of the speed targets also on FlexAttention (rows "<scheme> (flex)"), the cos/sin
            # rotary schemes also with the fused rotation (rows "<scheme> (fused)")
            step=(--device cuda --precision bf16 --batch 128 --steps 5 --rounds 5 --flex alibi2d lookhere irpe
                  --fused-rotary "${fused[@]}")
        fi
        run_part gpu_checks 150 "$PYTHON" bench/gpu_checks.py ${checks[@]+"${checks[@]}"} --out "$out"
        # with kernels and GPU time per step; about 3 minutes with the compilation of the flex and fused rows
        run_part throughput 420 "$PYTHON" bench/throughput.py "${step[@]}" --profile --out "$out"
        ;;
    smoke)
        if grep -q -- '"--out"' bench/gpu_smoke.py; then
            smoke_args+=(--out "$out")
        fi
        if [ "$dry" = 1 ]; then
            # its 20 warm-up steps need a GPU to be quick
            run_part gpu_smoke 60 "$PYTHON" bench/gpu_smoke.py --help
        else
            run_part gpu_smoke 480 "$PYTHON" bench/gpu_smoke.py ${smoke_args[@]+"${smoke_args[@]}"}
        fi
        ;;
    data)
        if [ "$dry" = 1 ]; then
            data=(--device cpu --dry-run --out "$out")
        else
            # target on an H200: the GPU pipeline at >= 90 % of the synthetic step rate
            data=(--device cuda --num-workers 16 --steps 60 --warmup 15 --out "$out")
            run_part augment_sync 120 "$PYTHON" -c "
import torch
from visionpe.training import BatchAugment
augment = BatchAugment(224).cuda()
x = torch.randint(0, 256, (256, 3, 224, 224), dtype=torch.uint8, device='cuda')
params = augment.sample_params(256)
torch.cuda.set_sync_debug_mode('error')  # raises on any host-device synchronisation
y = augment(x, params)
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
print('batched augmentation without synchronisation:', tuple(y.shape))"
        fi
        run_part data_pipeline 420 "$PYTHON" bench/data_pipeline.py "${data[@]}"
        ;;
    scenes)
        scenes=(--schemes none learned rope_axial rope_mixed --references --tasks region --seeds 0
                --extrapolation none pi ntk --out "$out/scenes_gpu" --reuse --results "$out" --results-name scenes_gpu)
        if [ "$dry" = 1 ]; then
            scenes+=(--quick)
        fi
        run_part scenes_gpu 560 "$PYTHON" train/scenes.py --config configs/scenes/scenes_gpu.yaml "${scenes[@]}"
        ;;
    fsdp)
        run_part fsdp 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/training/test_fsdp.py
        ;;
    fsdp2)
        if [ "$dry" = 1 ]; then  # two processes over gloo on the CPU, tiny sizes
            fsdp2=(--nproc_per_node 2 bench/fsdp2_check.py --device cpu --size 32 --dim 32 --heads 2)
        else
            gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
            if [ "$gpus" -lt 1 ]; then
                echo "--part fsdp2 needs a GPU (none visible); --dry-run checks it on the CPU" >&2
                exit 2
            fi
            fsdp2=(--nproc_per_node "$(( gpus >= 2 ? 2 : 1 ))" bench/fsdp2_check.py --device cuda)
        fi
        run_part fsdp2 300 "$PYTHON" -m torch.distributed.run --standalone "${fsdp2[@]}"
        if [ "$dry" = 1 ]; then  # the sharded attention over two gloo processes, a 48 x 80 px image
            seqpar=(--nproc_per_node 2 bench/sequence_parallel.py --device cpu --backend gloo --repeats 1)
        else
            seqpar=(--nproc_per_node "$(( gpus >= 2 ? 2 : 1 ))" bench/sequence_parallel.py --device cuda
                    --backend nccl --size 496 464 --depth 4 --dim 384 --heads 6)
        fi
        run_part sequence_parallel 300 "$PYTHON" -m torch.distributed.run --standalone "${seqpar[@]}"
        ;;
    compile)
        if [ "$dry" = 1 ]; then
            modes=(--device cpu --modes default --schemes rope_axial alibi2d --size 32 --depth 1 --batch 2 --steps 1)
        else
            modes=(--modes reduce-overhead max-autotune
                   --schemes rope_axial rope_mixed string_cayley alibi2d lookhere irpe liere comrope_ap)
        fi
        run_part compile_modes 560 "$PYTHON" bench/compile_modes.py "${modes[@]}" --out "$out"
        ;;
    esac
done
if [ "$dry" = 1 ]; then
    "$PYTHON" -c 'from bench.results import print_quick_notice; print_quick_notice("--dry-run")'
fi
echo "result files in $out:" && ls "$out"
exit "$status"
