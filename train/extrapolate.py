r"""Extrapolation sweep: accuracy at resolutions (or clip lengths) a model never saw, as a table, CSV and plot.

Evaluate trained checkpoints:

    python train/extrapolate.py --config configs/demo/digits.yaml --checkpoints runs/a/last.ckpt runs/b/last.ckpt \
        --sizes 32 48 64 96 128

Train each scheme from a config, then sweep (what ``scripts/digits.sh`` does on the bundled digits):

    python train/extrapolate.py --config configs/demo/digits.yaml --schemes learned rope_axial rope_mixed \
        --references timm_ape timm_rope_axial --seeds 0 1 2 --extrapolation none ntk --out runs/demo

The data module of the config provides ``eval_dataloader(size)`` (timm's eval transform at that size, or clips of
that many frames). ``--extrapolation`` adds a row per rotary model and mode, switched with
``visionpe.set_extrapolation`` after training (no retraining). A checkpoint is evaluated on the held-out split it
was trained with (its data module's seed and train fraction) and reported under its own seed, in a row labelled by
its scheme and its path. Arguments are checked before anything trains: repeated values, test sizes that the data or
a model refuses (one sample of each size goes through every model), modes that no model takes.

Output: a progress bar and a line (wall time, accuracy at the training size) per trained model, then the table;
``<out>/results.md``, ``results.csv`` (one row per model, seed and size) and ``results.png``, and per run
``<out>/<model>/seed<k>/`` with ``final.ckpt`` and the CSV and TensorBoard logs. ``--results DIR`` also writes the
table as ``DIR/<name>.md`` and ``DIR/<name>.csv`` (name: ``--results-name``, default the config's), headed by the
date, commit, versions, device and command, as the other benchmarks write theirs (``bench/results.py``), and the
plot as ``DIR/<name>.png``; the documentation's table and plot are ``--results docs/benchmarks/results`` (the only
way this script writes there: ``--out`` in that folder is refused).
``--verbose`` keeps Lightning's messages and model summaries. Importable: ``from extrapolate import main``.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import sys
from pathlib import Path

from experiments.sweep import REFERENCE_MODELS, bench_results, run_sweep


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
    parser.add_argument("--extrapolation", nargs="+", default=["none"], help="none pi ntk yarn riflex")
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
    parser.add_argument(
        "--results", default=None, help="also write the table as <results>/<name>.md and .csv with the run's header"
    )
    parser.add_argument("--results-name", default=None, help="file name for --results (default: the config's)")
    parser.add_argument(
        "--verbose", action="store_true", help="keep Lightning's information messages and model summary tables"
    )
    args = parser.parse_args(argv)
    if not (args.checkpoints or args.schemes or args.references):
        parser.error("give --checkpoints, --schemes or --references")
    error = bench_results().output_error(args.out, args.results)
    if error:
        parser.error(error)
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
        verbose=args.verbose,
    )
    print("\n" + paths["md"].read_text())
    out = Path(args.out)
    where = [
        ("table", paths["md"]),
        ("per-seed rows (CSV)", paths["csv"]),
        ("plot", paths["png"]),
    ]
    if args.schemes or args.references:
        where.append(("checkpoints and logs", out / "<model>" / "seed<k>" / "{final.ckpt,csv,tensorboard}"))
    if args.results is not None:
        name = args.results_name or Path(args.config).stem
        command = sys.argv if argv is None else [__file__, *argv]
        paths["results_md"], paths["results_csv"], paths["results_png"] = write_results_table(
            paths, args, name, command
        )
        where += [
            ("results table", paths["results_md"]),
            ("results CSV", paths["results_csv"]),
            ("results plot", paths["results_png"]),
        ]
    width = max(len(label) for label, _ in where)
    print("\n".join(f"{label + ':':<{width + 1}} {path}" for label, path in where))
    return paths


def write_results_table(
    paths: dict[str, Path], args: argparse.Namespace, name: str, command: list[str] | None = None
) -> tuple[Path, Path, Path]:
    """The sweep's table (mean ± std over seeds, a row per model) as ``<args.results>/<name>.md`` and ``.csv``,
    through the benchmarks' shared writer (first line the date, commit, torch/timm versions, device and
    ``command``, the argv; default ``sys.argv``), and its plot as ``<name>.png`` beside them."""
    import torch

    lines = [line for line in paths["md"].read_text().splitlines() if line.startswith("|")]
    columns, *body = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    table = [cells for cells in body if not set("".join(cells)) <= set("-:")]  # without the |---| line
    with paths["csv"].open(newline="") as f:
        seeds = sorted({int(row["seed"]) for row in csv.DictReader(f)})
    over = f"mean ± std over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    notes = [f"Top-1 accuracy (%) on the held-out split, {over}; config `{Path(args.config).as_posix()}`."]
    if any("[" in cells[0] for cells in table):
        notes.append(
            "`[mode]`: the same weights evaluated with that extrapolation mode (`pi`: position interpolation)."
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    md, csv_path = bench_results().write_results(
        name, table, columns, out_dir=args.results, command=command, notes=notes, device=device
    )
    png = Path(args.results) / f"{name}.png"
    shutil.copyfile(paths["png"], png)
    return md, csv_path, png


if __name__ == "__main__":
    main(sys.argv[1:])
