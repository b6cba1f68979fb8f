"""Multimodal extrapolation benchmark: small VLMs trained with each position scheme, measured on longer contexts.

A tiny transformers Qwen2-VL (built from a config, no downloaded weights) is trained from scratch with Lightning
for each (task, scheme, seed), its position scheme set with ``visionpe.integrations.hf.apply_position_scheme``,
and evaluated at every length. Tasks (from the bundled MNIST digits, deterministic per seed): grid question
answering (train R, C <= 3, evaluate n x n up to 6 x 6), multi-image needle (train K <= 4 images, evaluate up
to 16), video needle (train clips of up to 8 frames, evaluate up to 32). Settings and protocol:
``train/experiments/vlm/benchmark.py`` (this project's experiment code, not part of the installed package).

    .venv/bin/python bench/vlm_extrapolation.py --setting quick --out runs/vlm_quick      # ~1 min
    .venv/bin/python bench/vlm_extrapolation.py --setting small --seeds 0 1 2 --jobs 2 --out runs/vlm_small \
        --results docs/benchmarks/results                 # the published tables
    .venv/bin/python bench/vlm_extrapolation.py --setting small --seeds 0 1 2 --jobs 2 --out runs/vlm_small --reuse
    .venv/bin/python bench/vlm_extrapolation.py --setting small --tasks grid --schemes rope_1d mrope vrope
    .venv/bin/python bench/vlm_extrapolation.py --setting small --seeds 0 1 2 --jobs 2 --schemes cca pype \
        --results docs/benchmarks/results --update       # measure two schemes, keep the other rows of vlm.csv

Writes ``<out>/<task>.md``, ``<task>.csv``, ``<task>.png`` per task, ``summary.md`` and ``runs.csv``; each
finished run is saved under ``<out>/results/``, and ``--reuse`` continues an interrupted benchmark from there.
``--results DIR`` also writes ``DIR/vlm.md`` (every task's table under one first line naming the date, commit,
torch/timm versions, device and command, as ``bench/results.py`` heads every benchmark's file), ``DIR/vlm.csv``
(one row per task, scheme, seed and length) and ``DIR/vlm_<task>.png`` (every scheme of the table, accuracy against
length); the documentation's tables are ``--results docs/benchmarks/results``.
``--update`` (with ``--results`` and ``--schemes``) measures only the named schemes and keeps the rows of the other
schemes from the previous ``vlm.csv`` there, after checking that they were measured with this run's setting (steps,
questions per length, evaluation lengths) and seeds; otherwise it refuses and changes nothing. The tables of
``vlm.md`` are then made from the merged rows, under this run's header line and the earlier run's.
``--setting quick`` checks the pipeline and measures nothing: it says so in one line, and its ``--results`` (which
the tests use) may be any folder but the published one. ``--out`` is never the published folder.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.results
sys.path.insert(0, str(ROOT / "train"))  # the experiments package lives in train/

from bench.results import header, output_error, print_quick_notice  # noqa: E402
from experiments.vlm.benchmark import (  # noqa: E402
    SETTINGS,
    BenchSetting,
    load_trainer_config,
    plot_task,
    report_markdown,
    run_benchmark,
    skipped_schemes,
)
from experiments.vlm.schemes import BENCH_SCHEMES  # noqa: E402
from experiments.vlm.tasks import TASKS  # noqa: E402

KEPT = "Rows of "  # the start of the line naming the rows kept from an earlier run (--update)
FIELDS = ["task", "scheme", "seed", "length", "acc", "n", "train_length", "steps", "train_s", "eval_s"]


def report_rows(reports: dict) -> list[dict]:
    """The rows of every task's CSV of a :func:`run_benchmark` call (values as the CSV holds them, strings)."""
    rows = []
    for paths in reports.values():
        with paths["csv"].open(newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def _order(row: dict) -> tuple:
    tasks, schemes = list(TASKS), list(BENCH_SCHEMES)
    return (tasks.index(row["task"]), schemes.index(row["scheme"]), int(row["seed"]), int(row["length"]))


def write_results_files(
    rows: list[dict],
    results_dir: str | Path,
    command: list[str] | None = None,
    name: str = "vlm",
    earlier: str | None = None,
    older: Sequence[str] = (),
) -> tuple[Path, Path]:
    """``<results_dir>/<name>.md``: the run's header line (``command``: the argv, default ``sys.argv``), the earlier
    run's (``earlier``, for rows kept by ``--update``), then every task's report made from ``rows`` (a scheme that does
    not apply to a task gets a "not run" row); ``<name>.csv``: ``rows`` in task, scheme, seed and length order (header
    row first, no comments, so that it loads as it is); ``<name>_<task>.png`` per task: the plot of every scheme of
    its table. ``older``: the lines of rows that the earlier run had kept
    from runs before it (:func:`kept_lines`), written after the earlier run's, as they were."""
    if not rows:
        raise ValueError("rows must hold at least one result, got none")
    unknown = sorted(
        {(r["task"], r["scheme"]) for r in rows if r["task"] not in TASKS or r["scheme"] not in BENCH_SCHEMES}
    )
    if unknown:
        raise ValueError(f"rows name unknown (task, scheme) pairs {unknown}")
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=_order)
    sections = [header("cpu", command)]  # the benchmark trains and evaluates on the CPU (train_and_evaluate)
    if isinstance(older, str) or any(not isinstance(line, str) or not line.startswith(KEPT) for line in older):
        raise ValueError(f"older must be lines starting with {KEPT!r}, got {older!r}")
    if older and earlier is None:
        raise ValueError("older lines come with the earlier run's (earlier=...), got earlier=None")
    if earlier is not None:
        # a scheme named by an older line was measured by the run that line names, not by the earlier run
        from_older = {scheme for line in older for scheme in _kept_schemes(line)}
        kept = sorted({r["scheme"] for r in rows if r.get("kept")} - from_older, key=list(BENCH_SCHEMES).index)
        if kept:
            sections.append(f"Rows of {', '.join(kept)} kept from an earlier run (`--update`): measured {earlier}")
    sections += list(older)
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    for task in TASKS:
        if any(r["task"] == task for r in rows):
            text = report_markdown(task, rows, skipped_schemes(task, schemes)).strip()
            sections.append(text.replace("# ", "## ", 1))
            plot_task(task, rows, out / f"{name}_{task}.png")
    md_path, csv_path = out / f"{name}.md", out / f"{name}.csv"
    md_path.write_text("\n\n".join(sections) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return md_path, csv_path


def previous_rows(results_dir: str | Path, name: str = "vlm") -> tuple[list[dict], str]:
    """The rows of ``<results_dir>/<name>.csv`` and the first line of ``<name>.md`` (when and how they were measured),
    for ``--update``; a ValueError when either file is missing or the CSV lacks a column."""
    out = Path(results_dir)
    csv_path, md_path = out / f"{name}.csv", out / f"{name}.md"
    if not csv_path.is_file() or not md_path.is_file():
        raise ValueError(
            f"--update needs the {name}.csv and {name}.md that an earlier --results run wrote in {results_dir}, "
            f"found {[p.name for p in (csv_path, md_path) if p.is_file()]}"
        )
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in FIELDS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{csv_path.name} lacks the columns {missing}; it has {reader.fieldnames}")
        rows = list(reader)
    return rows, md_path.read_text().splitlines()[0].removeprefix("Measured ")


def kept_lines(results_dir: str | Path, schemes: Sequence[str], name: str = "vlm") -> list[str]:
    """The lines of ``<results_dir>/<name>.md`` naming rows that its run kept from runs before it (``--update``) of
    at least one of ``schemes`` (the schemes kept again), so that a further ``--update`` keeps saying where those rows
    were measured; [] without the file."""
    if isinstance(schemes, str) or any(s not in BENCH_SCHEMES for s in schemes):
        raise ValueError(f"schemes must be a list of {list(BENCH_SCHEMES)}, got {schemes!r}")
    md_path = Path(results_dir) / f"{name}.md"
    if not md_path.is_file():
        return []
    return [
        line
        for line in md_path.read_text().splitlines()
        if line.startswith(KEPT) and set(_kept_schemes(line)) & set(schemes)
    ]


def _kept_schemes(line: str) -> list[str]:
    """The schemes a "Rows of ... kept from ..." line names."""
    return line.removeprefix(KEPT).split(" kept from ")[0].split(", ")


def check_previous_rows(
    rows: list[dict], setting: BenchSetting, seeds: list[int], schemes: list[str], tasks: list[str]
) -> list[dict]:
    """The rows of the (task, scheme) pairs this run does not measure (``schemes`` x ``tasks``), after checking that
    they come from ``setting`` and ``seeds``: every seed has the setting's evaluation lengths, steps and questions per
    length, and the seeds of every (task, scheme) are exactly ``seeds`` on the tasks this run measures (rows of one
    table), or on another task the seeds of every other scheme of that task. A ValueError names the first
    difference."""
    kept = [r for r in rows if r["scheme"] not in schemes or r["task"] not in tasks]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in kept:
        if row["task"] not in TASKS or row["scheme"] not in BENCH_SCHEMES:
            raise ValueError(f"previous rows name an unknown task or scheme: {row['task']!r}, {row['scheme']!r}")
        groups.setdefault((row["task"], row["scheme"]), []).append(row)
    table_seeds = {task: sorted(seeds) for task in tasks}
    for (task, scheme), group in groups.items():
        where = f"previous rows of {scheme} on {task}"
        got_seeds = sorted({int(r["seed"]) for r in group})
        expected = table_seeds.setdefault(task, got_seeds)
        if got_seeds != expected:
            other = "this run" if task in tasks else "other schemes of that task"
            raise ValueError(f"{where} have seeds {got_seeds}, {other} {expected}")
        if task not in setting.steps:
            raise ValueError(f"{where}: setting {setting.name!r} has no steps for task {task!r}")
        for seed in got_seeds:
            lengths = sorted(int(r["length"]) for r in group if int(r["seed"]) == seed)
            if lengths != sorted(setting.lengths(task)):
                raise ValueError(
                    f"{where}, seed {seed}: lengths {lengths}, setting {setting.name!r} evaluates "
                    f"{sorted(setting.lengths(task))}"
                )
        for row in group:
            if int(row["steps"]) != setting.steps[task] or int(row["n"]) != setting.eval_samples:
                raise ValueError(
                    f"{where}, seed {row['seed']}: {row['steps']} steps and {row['n']} questions per length, setting "
                    f"{setting.name!r} trains {setting.steps[task]} steps and asks {setting.eval_samples}"
                )
    return [{**r, "kept": True} for r in kept]


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
    parser.add_argument(
        "--trainer-config",
        help="YAML file whose 'trainer' section replaces accelerator='cpu', devices=1 (e.g. configs/fsdp/vlm.yaml)",
    )
    parser.add_argument("--results", help="also write <results>/vlm.md and vlm.csv, headed by the run's settings")
    parser.add_argument(
        "--update",
        action="store_true",
        help="with --results and --schemes: measure only these schemes and keep the other schemes' rows of the "
        "previous <results>/vlm.csv (refused unless they come from the same setting and seeds)",
    )
    args = parser.parse_args(argv)
    quick = "--setting quick" if args.setting == "quick" else None
    error = output_error(args.out, args.results, quick, quick_results=True)
    if error:
        parser.error(error)
    if quick:
        print_quick_notice(quick)
    kept, earlier, older = [], None, []
    if args.update:
        if args.results is None or not args.schemes:
            parser.error(
                "--update needs --results (the folder of the previous vlm.csv) and --schemes (what to measure)"
            )
        try:
            previous, earlier = previous_rows(args.results)
            tasks = args.tasks or list(SETTINGS[args.setting].tasks)
            kept = check_previous_rows(previous, SETTINGS[args.setting], args.seeds, args.schemes, tasks)
            older = kept_lines(args.results, sorted({r["scheme"] for r in kept}))
        except ValueError as err:
            parser.exit(2, f"--update refused, nothing was changed: {err}\n")
    trainer_args = None
    if args.trainer_config is not None:
        try:
            trainer_args = load_trainer_config(args.trainer_config)
        except (OSError, TypeError, ValueError) as err:
            parser.error(f"--trainer-config: {err}")
    reports = run_benchmark(
        args.setting,
        schemes=args.schemes,
        tasks=args.tasks,
        seeds=args.seeds,
        out_dir=args.out,
        jobs=args.jobs,
        threads=args.threads,
        reuse=args.reuse,
        trainer_args=trainer_args,
    )
    if args.results is not None:
        command = sys.argv if argv is None else [__file__, *argv]
        rows = kept + report_rows(reports)
        md_path, csv_path = write_results_files(
            rows, args.results, command, earlier=earlier if kept else None, older=older if kept else ()
        )
        print(f"results: {md_path}, {csv_path}")
    return reports


if __name__ == "__main__":
    main()
