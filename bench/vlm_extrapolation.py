"""Multimodal extrapolation benchmark: small VLMs trained with each position scheme, measured on longer contexts.

A tiny transformers Qwen2-VL (built from a config, no downloaded weights) is trained from scratch with Lightning
for each (task, scheme, seed), its position scheme set with ``visionpe.integrations.hf.apply_position_scheme``,
and evaluated at every length. Tasks (from the bundled MNIST digits, deterministic per seed): grid question
answering (train R, C <= 3, evaluate n x n up to 6 x 6), multi-image needle (train K <= 4 images, evaluate up
to 16), video needle (train clips of up to 8 frames, evaluate up to 32). Settings and protocol:
``train/experiments/vlm/benchmark.py`` (this project's experiment code, not part of the installed package).

    .venv/bin/python bench/vlm_extrapolation.py --setting quick --out runs/vlm_quick      # ~1 min
    .venv/bin/python bench/vlm_extrapolation.py --setting small --seeds 0 1 2 --jobs 2 --out runs/vlm_small
    .venv/bin/python bench/vlm_extrapolation.py --setting small --seeds 0 1 2 --jobs 2 --out runs/vlm_small --reuse
    .venv/bin/python bench/vlm_extrapolation.py --setting small --tasks grid --schemes rope_1d mrope vrope

Writes ``<out>/<task>.md``, ``<task>.csv``, ``<task>.png`` per task, ``summary.md`` and ``runs.csv``; each
finished run is saved under ``<out>/results/``, and ``--reuse`` continues an interrupted benchmark from there.
``--results DIR`` also writes ``DIR/vlm.md`` (every task's table under one first line naming the date, commit,
torch/timm versions, device and command, as ``bench/results.py`` heads every benchmark's file) and ``DIR/vlm.csv``
(one row per task, scheme, seed and length); the documentation's tables are ``--results docs/benchmarks/results``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.results
sys.path.insert(0, str(ROOT / "train"))  # the experiments package lives in train/

from bench.results import header  # noqa: E402
from experiments.vlm.benchmark import SETTINGS, run_benchmark  # noqa: E402
from experiments.vlm.schemes import BENCH_SCHEMES  # noqa: E402
from experiments.vlm.tasks import TASKS  # noqa: E402


def write_results_files(
    reports: dict, results_dir: str | Path, command: list[str] | None = None, name: str = "vlm"
) -> tuple[Path, Path]:
    """``<results_dir>/<name>.md``: the run's header line (``command``: the argv, default ``sys.argv``), then every
    task's report; ``<name>.csv``: the rows of every task's CSV (header row first, no comments, so that it loads as
    it is)."""
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = [header("cpu", command)]  # the benchmark trains and evaluates on the CPU (train_and_evaluate)
    rows, fields = [], None
    for paths in reports.values():
        text = paths["md"].read_text().strip()
        sections.append(text.replace("# ", "## ", 1) if text.startswith("# ") else text)
        with paths["csv"].open(newline="") as f:
            reader = csv.DictReader(f)
            fields = fields or reader.fieldnames
            rows += list(reader)
    md_path, csv_path = out / f"{name}.md", out / f"{name}.csv"
    md_path.write_text("\n\n".join(sections) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return md_path, csv_path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="quick", help="quick (test) or small (README)")
    parser.add_argument("--schemes", nargs="+", choices=list(BENCH_SCHEMES), help="default: the setting's")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), help="default: the setting's")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", default="runs/vlm_extrapolation", help="run folder for tables, CSVs and plots")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, one process each (2 on 2 cores)")
    parser.add_argument("--threads", type=int, help="torch threads per run (default: cores / jobs)")
    parser.add_argument("--reuse", action="store_true", help="load runs saved under --out instead of training again")
    parser.add_argument("--results", help="also write <results>/vlm.md and vlm.csv, headed by the run's settings")
    args = parser.parse_args(argv)
    reports = run_benchmark(
        args.setting,
        schemes=args.schemes,
        tasks=args.tasks,
        seeds=args.seeds,
        out_dir=args.out,
        jobs=args.jobs,
        threads=args.threads,
        reuse=args.reuse,
    )
    if args.results is not None:
        command = sys.argv if argv is None else [__file__, *argv]
        md_path, csv_path = write_results_files(reports, args.results, command)
        print(f"results: {md_path}, {csv_path}")
    return reports


if __name__ == "__main__":
    main()
