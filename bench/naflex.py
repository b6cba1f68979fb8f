"""Training throughput on a mixed-resolution (NaFlex) batch: visionpe schemes inside timm's NaFlexVit against
timm's NaFlexVit with its own learned table, in one run.

A batch of ``--batch`` images at different grids (aspect ratios from 9:16 to 2:1, up to ``--seq-len`` patches each),
in timm's NaFlex layout (``patches``, ``patch_coord``, ``patch_valid``, padded to ``--seq-len``), forward + backward
on CPU (by default). The baseline is ``timm.create_model("naflexvit_base_patch16_gap")`` at ViT-S width and depth
(384, 12, 6 heads), which adds its table per image and runs one padded attention with a mask. Each visionpe row is
the same model after :func:`~visionpe.integrations.timm.apply_position_scheme`: ``learned (own table)`` is the
model's own table translated (the same logits), the other rows replace it by the scheme named; those models encode
each image at its own grid and run attention grid by grid on the valid tokens (``visionpe.models.naflex``). Every
model is timed in interleaved rounds (each once per round) and the median step time is reported; ratios are against
the baseline measured in the same run.

    .venv/bin/python bench/naflex.py                       # writes runs/bench/naflex/naflex.*
    .venv/bin/python bench/naflex.py --results docs/benchmarks/results   # and the published table
    .venv/bin/python bench/naflex.py --schemes rope_axial alibi2d --rounds 5
    .venv/bin/python bench/naflex.py --quick               # a tiny model and one round: a smoke run

The table printed is also written to ``<--out>/naflex.md`` and ``naflex.csv`` (default ``runs/bench/naflex``;
``bench/results.py``) and copied to ``--results DIR`` when given: the published table is ``--results
docs/benchmarks/results``. ``--quick`` checks the pipeline and measures nothing: it says so in one line and takes no
``--results``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import visionpe  # noqa: E402, F401  (registers the schemes)
from bench.results import add_output_arguments, copy_results, output_error, print_quick_notice, write_results  # noqa: E402
from visionpe.integrations.timm import apply_position_scheme  # noqa: E402

BASELINE = "naflexvit_base_patch16_gap"
SCHEMES = ["rope_axial", "rope_mixed", "rope_dinov3", "alibi2d", "cpe"]
# (aspect ratio h / w, share of the sequence length) of the images of a batch, repeated for larger batches
SHAPES = [(1.0, 1.0), (0.75, 0.9), (4 / 3, 0.8), (0.5, 0.7), (2.0, 0.6), (9 / 16, 1.0), (16 / 9, 0.85), (1.0, 0.5)]


def grids(batch: int, seq_len: int) -> list[tuple[int, int]]:
    """``batch`` grids (H, W), each with at most ``seq_len`` patches, cycling through :data:`SHAPES`."""
    out = []
    for i in range(batch):
        ratio, share = SHAPES[i % len(SHAPES)]
        area = max(1.0, share * seq_len)
        height = max(1, int(math.sqrt(area * ratio)))
        width = max(1, min(int(area / height), seq_len // height))
        out.append((height, width))
    return out


def naflex_batch(grid_sizes: list[tuple[int, int]], patch: int, seq_len: int, seed: int = 0) -> dict:
    """Random patches of images at ``grid_sizes`` in timm's NaFlex layout, padded to ``seq_len`` patches."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(grid_sizes)
    patches = torch.zeros(batch, seq_len, patch * patch * 3)
    coord = torch.zeros(batch, seq_len, 2, dtype=torch.long)
    valid = torch.zeros(batch, seq_len, dtype=torch.bool)
    for i, (height, width) in enumerate(grid_sizes):
        n = height * width
        patches[i, :n] = torch.randn(n, patch * patch * 3, generator=gen)
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        coord[i, :n] = torch.stack((ys.flatten(), xs.flatten()), dim=1)
        valid[i, :n] = True
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def step_time(model: torch.nn.Module, batch: dict) -> float:
    """Seconds of one forward + backward on ``batch``."""
    start = time.perf_counter()
    model(batch).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def build_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """The baseline, its own table translated, and one swapped copy per scheme, in training mode."""
    shape = dict(embed_dim=args.width, depth=args.depth, num_heads=args.heads, patch_size=args.patch)
    grid = int(math.isqrt(args.seq_len))
    base = timm.create_model(BASELINE, num_classes=10, pos_embed_grid_size=(grid, grid), **shape).train()
    models = {f"timm {BASELINE} (own learned table, baseline)": base}
    own = copy.deepcopy(base)
    apply_position_scheme(own)
    models["visionpe learned (own table translated)"] = own
    for name in args.schemes:
        model = copy.deepcopy(base)
        apply_position_scheme(model, name)
        models[f"visionpe {name}"] = model
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=SCHEMES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="largest patch count of an image; the padded N")
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="width 64, depth 2, 2 heads, 64 patches, one round")
    add_output_arguments(parser, "naflex", "naflex.md and .csv")
    args = parser.parse_args()
    error = output_error(args.out, args.results, "--quick" if args.quick else None)
    if error:
        parser.error(error)
    if args.quick:
        print_quick_notice("--quick")
        args.width, args.depth, args.heads, args.seq_len, args.rounds, args.warmup = 64, 2, 2, 64, 1, 0
    torch.manual_seed(0)
    grid_sizes = grids(args.batch, args.seq_len)
    batch = naflex_batch(grid_sizes, args.patch, args.seq_len)
    valid = int(batch["patch_valid"].sum())
    models = build_models(args)
    for _ in range(args.warmup):
        for model in models.values():
            step_time(model, batch)
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, model in models.items():
            times[label].append(step_time(model, batch))
    settings = (
        f"batch {args.batch} of grids {', '.join(f'{h}x{w}' for h, w in grid_sizes)} ({valid} of "
        f"{args.batch * args.seq_len} patch slots valid), patch {args.patch}, width {args.width}, depth {args.depth}, "
        f"{args.heads} heads, fp32 forward + backward, median of {args.rounds} round(s), "
        f"{torch.get_num_threads()} threads" + (", quick mode" if args.quick else "")
    )
    print(settings)
    print("| model | images/s | ratio to timm NaFlexVit |")
    print("|---|---|---|")
    baseline = statistics.median(next(iter(times.values())))
    rows = []
    for label, seconds in times.items():
        median = statistics.median(seconds)
        rows.append([label, args.batch / median, baseline / median])
        print(f"| {label} | {args.batch / median:.1f} | {baseline / median:.3f}x |", flush=True)
    columns = ["model", "images/s", "ratio to timm NaFlexVit"]
    notes = f"NaFlex training step on one mixed-resolution batch: {settings}; ratio = images/s / baseline's images/s."
    paths = write_results(
        "naflex",
        rows,
        columns,
        out_dir=args.out,
        notes=notes,
        formats={"images/s": ".1f", "ratio to timm NaFlexVit": ".3f"},
    )
    if args.results is not None:
        paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
