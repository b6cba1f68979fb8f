r"""Extrapolation sweep: accuracy at resolutions (or clip lengths) a model never saw, as a table, CSV and plot.

Evaluate trained checkpoints:

    python train/extrapolate.py --config configs/demo/digits.yaml --checkpoints runs/a/last.ckpt runs/b/last.ckpt \
        --sizes 32 48 64 96 128

Train each scheme from a config, then sweep (what ``scripts/run.sh`` does on the bundled digits):

    python train/extrapolate.py --config configs/demo/digits.yaml --schemes learned rope_axial rope_mixed \
        --references timm_ape timm_rope_axial --seeds 0 1 2 --extrapolation none ntk --out runs/demo

The data module of the config provides ``eval_dataloader(size)`` (timm's eval transform at that size, or clips of
that many frames). ``--extrapolation`` adds a row per rotary model and mode, switched with
``visionpe.set_extrapolation`` after training (no retraining). A checkpoint is evaluated on the held-out split it
was trained with (its data module's seed and train fraction) and reported under its own seed, in a row labelled by
its scheme and its path. Arguments are checked before anything trains: repeated values, test sizes that the data or
a model refuses (one sample of each size goes through every model), modes that no model takes.
Importable: ``from extrapolate import main``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.sweep import REFERENCE_MODELS, run_sweep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="training config (LightningCLI YAML) with the data module")
    parser.add_argument("--checkpoints", nargs="*", default=[], help="Lightning checkpoints of trained Classifiers")
    parser.add_argument("--schemes", nargs="*", default=[], help="visionpe schemes to train with --config")
    parser.add_argument(
        "--references", nargs="*", default=[], choices=sorted(REFERENCE_MODELS), help="timm models trained alike"
    )
    parser.add_argument("--sizes", nargs="+", type=int, default=None, help="test sizes (default: the data's)")
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="seeds of the trained runs (checkpoints keep their own)"
    )
    parser.add_argument("--extrapolation", nargs="+", default=["none"], help="none pi ntk yarn")
    parser.add_argument("--max-epochs", type=int, default=None, help="override trainer.max_epochs")
    parser.add_argument(
        "--override",
        nargs="*",
        default=[],
        help="LightningCLI arguments for every run, without leading dashes, e.g. data.init_args.train_subset=512",
    )
    parser.add_argument("--out", default="runs/extrapolate", help="output folder (table, CSV, plot, checkpoints)")
    parser.add_argument("--title", default=None)
    parser.add_argument(
        "--reuse", action="store_true", help="load runs that already finished under --out instead of training again"
    )
    args = parser.parse_args(argv)
    if not (args.checkpoints or args.schemes or args.references):
        parser.error("give --checkpoints, --schemes or --references")
    return args


def main(argv: list[str] | None = None) -> dict[str, Path]:
    args = parse_args(argv)
    paths = run_sweep(
        config=args.config,
        checkpoints=args.checkpoints,
        schemes=args.schemes,
        references=args.references,
        sizes=args.sizes,
        seeds=args.seeds,
        extrapolation=args.extrapolation,
        max_epochs=args.max_epochs,
        overrides=[a if a.startswith("--") else f"--{a}" for a in args.override],
        out_dir=args.out,
        title=args.title,
        reuse=args.reuse,
    )
    print(paths["md"].read_text())
    print(f"table: {paths['md']}\ncsv: {paths['csv']}\nplot: {paths['png']}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
