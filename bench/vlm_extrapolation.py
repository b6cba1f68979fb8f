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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # the experiments package lives in train/

from experiments.vlm.benchmark import SETTINGS, run_benchmark  # noqa: E402
from experiments.vlm.schemes import BENCH_SCHEMES  # noqa: E402
from experiments.vlm.tasks import TASKS  # noqa: E402


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
    args = parser.parse_args(argv)
    return run_benchmark(
        args.setting,
        schemes=args.schemes,
        tasks=args.tasks,
        seeds=args.seeds,
        out_dir=args.out,
        jobs=args.jobs,
        threads=args.threads,
        reuse=args.reuse,
    )


if __name__ == "__main__":
    main()
