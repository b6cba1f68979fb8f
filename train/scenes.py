r"""The scenes benchmark: every scheme trained on each task of procedural scenes, evaluated beyond the training size.

The whole benchmark (every registered visionpe scheme and timm's three reference models, every task, 3 seeds, zoom
and canvas at 1, 1.5, 2, 3 and 4 times the training side, every extrapolation mode a model accepts):

    python train/scenes.py --config configs/scenes/scenes.yaml --results docs/benchmarks/results

A check of the whole pipeline in a few minutes or less (NoPE and RoPE-Axial, a small model, a few steps, 2 sizes;
it says in one line that its numbers measure nothing, and its ``--results`` may be any folder but the published one):

    python train/scenes.py --config configs/scenes/scenes.yaml --quick

Each (task, scheme, seed) is trained by Lightning exactly as ``train/classify.py fit --config CONFIG`` would with
``--data.init_args.task=<task>`` (see ``train/experiments/scenes.py`` for the tasks), then evaluated on the fixed
evaluation sets of every kind (``zoom``: the same scenes with more pixels; ``canvas``: a larger field at the
training pixel size) and scale, under every mode of ``--extrapolation`` the model accepts
(``visionpe.set_extrapolation``, no retraining). Everything that can be checked before training is checked first:
unknown tasks, kinds or modes, repeated values, sizes that are not whole pixels, not a multiple of the patch, or
that a model refuses.

Output under ``--out``: ``results.csv`` (one row per task, kind, model, mode, seed and scale), ``results.md`` (a
table per task and kind, mean ± std over seeds), ``results.png`` (accuracy against size in units of the training
size, one panel per task and kind, a colour per model and a line style per mode, error bars: std over seeds), and
per run ``<task>/<model>/seed<k>/`` with ``final.ckpt``, its logs and ``eval.csv``. ``--reuse`` continues an
interrupted run or extends a finished one: finished trainings and evaluated sets are loaded and only the missing
ones are done (a run given more sizes, kinds or modes evaluates only those). ``--results DIR`` also writes
``DIR/<name>.md``, ``.csv`` and ``.png`` (name: ``--results-name``, default ``scenes``), headed by the date, commit,
versions, device and command (``bench/results.py``). ``--jobs N`` trains N runs at once, one process each (``--jobs 2``
on 2 cores). Importable: ``from scenes import main``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
import yaml

import visionpe
from experiments.cli import run_cli
from experiments.scenes import KINDS, TASKS, check_task, row_blind_count_accuracy
from experiments.sweep import (
    FINAL_CHECKPOINT,
    REFERENCE_MODELS,
    _check_distinct,
    _format_seconds,
    _probe,
    _scalable,
    _trained_line,
    accepts_extrapolation,
    bench_results,
    call_by_name,
    check_config,
    quiet_lightning,
    reference_args,
    set_worker_threads,
    train_from_config,
)
from visionpe.checks import check_int
from visionpe.rotary.scaling import EXTRAPOLATION_MODES, set_extrapolation
from visionpe.training.evaluate import accuracy, plot_palette

SCALES = (1.0, 1.5, 2.0, 3.0, 4.0)
#: a model below this accuracy (%) at the training size, without a mode, did not learn its task in the benchmark's
#: budget: its row is kept and marked, rather than given a schedule of its own
LEARNED = 95.0
NOT_LEARNED_MARK = "†"
FIELDS = ["task", "kind", "model", "mode", "seed", "scale", "size", "acc", "n"]


def scheme_options(name: str, embed_dim: int) -> dict:
    """``model.pos_embed_kwargs`` for scheme ``name`` in this benchmark (empty: the scheme's defaults).

    The learned tables (``learned``, ``learned_factorized``) start at big_vision's scale, std
    ``1 / sqrt(embed_dim)`` (0.125 at width 64), instead of timm's 0.02: at 0.02 a table is so small next to the
    embedding of a 4 x 4 patch that the gradient reaching it vanishes and the model never leaves chance on the
    position tasks in this schedule (measured: loss stuck at ln 4 for 600 steps). timm's APE reference row keeps
    timm's own initialisation, as a reference should.

    SeqPE's position network is scaled to the model as in the digits benchmark (width ``embed_dim // 2``, the
    paper's ratio of half the model width, 2 heads): at its default width 384 its two auxiliary losses cost tens of
    times the step of this small model.
    """
    if name in ("learned", "learned_factorized"):
        return {"init_std": embed_dim**-0.5}
    if name == "seqpe":
        return {"embed_dim": embed_dim // 2, "encoder_heads": 2}
    return {}


def _scheme_args(name: str, embed_dim: int) -> list[str]:
    options = scheme_options(name, embed_dim)
    args = [f"--model.pos_embed={name}"]
    if options:
        args.append(f"--model.pos_embed_kwargs={yaml.safe_dump(options, default_flow_style=True).strip()}")
    return args


# --quick: a check of the pipeline, not a measurement (the model does not converge in 10 steps)
QUICK = {
    "schemes": ["none", "rope_axial"],
    "references": [],
    "seeds": [0],
    "scales": [1.0, 2.0],
    "extrapolation": ["none", "ntk"],
    "model_kwargs": {"embed_dim": 32, "depth": 2, "num_heads": 2},
    "overrides": [
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.steps_per_epoch=10",
        "--data.init_args.batch_size=32",
        "--data.init_args.val_samples=32",
        "--data.init_args.eval_samples=96",
        "--data.init_args.eval_batch_size=96",
        "--model.warmup_epochs=0.2",
    ],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/scenes/scenes.yaml", help="training config (LightningCLI YAML)")
    parser.add_argument("--schemes", nargs="*", default=None, help="visionpe schemes (default: every registered one)")
    parser.add_argument(
        "--references",
        nargs="*",
        default=None,
        help=f"timm models trained alike (default: all of {sorted(REFERENCE_MODELS)})",
    )
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), help=f"tasks (default: all of {TASKS})")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), help="zoom, canvas or both (default)")
    parser.add_argument(
        "--scales", nargs="+", type=float, default=None, help="test sides in units of the training side (1 1.5 2 3 4)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default 0 1 2)")
    parser.add_argument(
        "--extrapolation", nargs="+", default=None, help=f"modes (default: all of {EXTRAPOLATION_MODES})"
    )
    parser.add_argument(
        "--override", nargs="*", default=[], help="LightningCLI arguments for every run, without leading dashes"
    )
    parser.add_argument("--out", default=None, help="output folder (default runs/scenes, runs/scenes_quick)")
    parser.add_argument("--reuse", action="store_true", help="load finished trainings and evaluations under --out")
    parser.add_argument("--quick", action="store_true", help="a check of the pipeline: 2 schemes, short runs, 2 sizes")
    parser.add_argument("--results", default=None, help="also write <results>/<name>.md, .csv and .png")
    parser.add_argument("--results-name", default="scenes", help="file name for --results")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's messages and model summaries")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, one process each (2 on 2 cores)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / jobs)")
    args = parser.parse_args(argv)
    # --quick writes --results where it is told (its tests, bench/gpu_smoke.sh --dry-run), never the published folder
    error = bench_results().output_error(args.out, args.results, "--quick" if args.quick else None, quick_results=True)
    if error:
        parser.error(error)
    return args


def _settings(args: argparse.Namespace) -> dict:
    """The runs' settings: the quick ones under ``--quick``, the defaults otherwise; explicit arguments win."""
    quick = QUICK if args.quick else {}

    def pick(name, default):
        value = getattr(args, name)
        return value if value is not None else quick.get(name, default)

    overrides = list(quick.get("overrides", []))
    with check_config(args.config).open() as f:
        model_kwargs = dict(yaml.safe_load(f)["model"].get("model_kwargs") or {})
    if args.quick:
        model_kwargs.update(QUICK["model_kwargs"])
        overrides.append(f"--model.model_kwargs={yaml.safe_dump(model_kwargs, default_flow_style=True).strip()}")
    overrides += [a if a.startswith("--") else f"--{a}" for a in args.override]
    return {
        "schemes": pick("schemes", visionpe.list_schemes()),
        "references": pick("references", sorted(REFERENCE_MODELS)),
        "seeds": pick("seeds", [0, 1, 2]),
        "scales": pick("scales", list(SCALES)),
        "extrapolation": pick("extrapolation", list(EXTRAPOLATION_MODES)),
        "overrides": overrides,
        "embed_dim": model_kwargs.get("embed_dim", 192),  # visionpe_vit_tiny's width unless the config sets one
        "out": Path(args.out or ("runs/scenes_quick" if args.quick else "runs/scenes")),
    }


def _sizes(scales: Sequence[float], img_size: int) -> list[int]:
    """The test sides in px; a ValueError for a scale that does not give whole pixels."""
    sizes = []
    for scale in scales:
        if not math.isfinite(scale) or scale < 1:
            raise ValueError(f"scales must be numbers >= 1 (units of the training side), got {scale}")
        size = scale * img_size
        if not math.isclose(size, round(size), abs_tol=1e-9):
            raise ValueError(f"scales must give whole pixels: {scale} x {img_size} px = {size} px")
        sizes.append(round(size))
    return sizes


def check_arguments(config: str | Path, settings: dict, tasks: Sequence[str], kinds: Sequence[str]) -> dict:
    """Check everything that can be checked before training; return the runs, data modules and sizes.

    ValueError for: a missing config, an unknown task, kind, reference or extrapolation mode, a repeated scheme,
    reference, task, kind, seed, scale or mode, a scale that gives no whole pixels, a size the data refuses (not a
    multiple of the patch, no whole lattice cells) or a model refuses, a mode that no model accepts.
    """
    check_config(config)
    for task in tasks:
        check_task(task)
    bad_kinds = [k for k in kinds if k not in KINDS]
    if bad_kinds:
        raise ValueError(f"kinds must be in {KINDS}, got {bad_kinds}")
    unknown = [r for r in settings["references"] if r not in REFERENCE_MODELS]
    if unknown:
        raise ValueError(f"references must be in {sorted(REFERENCE_MODELS)}, got {unknown}")
    bad_modes = [m for m in settings["extrapolation"] if m not in EXTRAPOLATION_MODES]
    if bad_modes:
        raise ValueError(f"extrapolation modes must be in {EXTRAPOLATION_MODES}, got {bad_modes}")
    for name, values in (
        ("schemes", settings["schemes"]),
        ("references", settings["references"]),
        ("tasks", tasks),
        ("kinds", kinds),
        ("seeds", settings["seeds"]),
        ("scales", settings["scales"]),
        ("extrapolation", settings["extrapolation"]),
    ):
        _check_distinct(name, values)
    for seed in settings["seeds"]:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seeds must be ints >= 0, got {seed!r}")
    runs = [(name, _scheme_args(name, settings["embed_dim"])) for name in settings["schemes"]]
    runs += [(REFERENCE_MODELS[r][0], reference_args(r)) for r in settings["references"]]
    if not runs:
        raise ValueError("give at least one scheme or reference model")

    common = settings["overrides"]
    data = {}
    for task in tasks:
        datamodule = run_cli(args=["--config", str(config), f"--data.init_args.task={task}", *common], run=False)
        data[task] = datamodule.datamodule
    first = data[tasks[0]]
    sizes = _sizes(settings["scales"], first.img_size)
    _check_distinct("sizes", sizes)
    for task, datamodule in data.items():
        for size in sizes:
            for kind in kinds:
                try:
                    datamodule.check_size(size, kind)
                except ValueError as err:
                    raise ValueError(
                        f"scale {size / first.img_size:g} ({size} px) does not work for {task}: {err}"
                    ) from err
    # every model at every size (random weights): an option a scheme does not take, or a size it refuses, fails now
    samples = {size: next(iter(first.eval_dataloader(size, kinds[-1])))[0][:1] for size in sizes}
    models = []
    for label, run_args in runs:
        cli = run_cli(
            args=["--config", str(config), *run_args, f"--data.init_args.task={tasks[0]}", *common], run=False
        )
        _probe(cli.model, samples, label)
        models.append((label, cli.model))
    for mode in settings["extrapolation"]:
        if not any(accepts_extrapolation(model.model, mode) for _, model in models):
            raise ValueError(f"extrapolation mode {mode!r} is accepted by none of {[label for label, _ in models]}")
    return {"runs": runs, "sizes": sizes, "img_size": first.img_size, "density": first.density}


def _read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return [
            {
                **row,
                "seed": int(row["seed"]),
                "scale": float(row["scale"]),
                "size": int(row["size"]),
                "acc": float(row["acc"]),
                "n": int(row["n"]),
            }
            for row in csv.DictReader(f)
        ]


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: row[k] for k in FIELDS} for row in rows)


def evaluate(model, datamodule, task, label, seed, kinds, sizes, modes, device, skip=frozenset()) -> list[dict]:
    """Rows of ``model`` on every evaluation set (kind x size) under every mode it accepts (then back to none),
    except the (kind, size, mode) in ``skip`` (already evaluated: each set is drawn from the seed, kind and size
    alone, so a row does not depend on which others are evaluated with it)."""
    rows = []
    accepted = [m for m in modes if accepts_extrapolation(model.model, m)]
    rotary = bool(_scalable(model.model))
    for kind in kinds:
        for size in sizes:
            todo = [m for m in accepted if (kind, size, m) not in skip]
            if not todo:
                continue
            loader = datamodule.eval_dataloader(size, kind)
            for mode in todo:
                if rotary:
                    set_extrapolation(model.model, mode)
                acc = accuracy(model, loader, device)
                rows.append(
                    {
                        "task": task,
                        "kind": kind,
                        "model": label,
                        "mode": mode,
                        "seed": seed,
                        "scale": size / datamodule.img_size,
                        "size": size,
                        "acc": acc,
                        "n": datamodule.eval_samples,
                    }
                )
    if rotary:
        set_extrapolation(model.model, "none")
    return rows


def _summary(rows: list[dict]) -> dict[tuple, tuple[float, float, int]]:
    """{(task, kind, model, mode, scale): (mean, std, seeds)} of the accuracy over seeds."""
    grouped: dict[tuple, list[float]] = {}
    for row in rows:
        key = (row["task"], row["kind"], row["model"], row["mode"], float(row["scale"]))
        grouped.setdefault(key, []).append(float(row["acc"]))
    return {k: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)) for k, v in grouped.items()}


def _ordered(rows: list[dict], field: str) -> list:
    return list(dict.fromkeys(row[field] for row in rows))


def _row_label(model: str, mode: str) -> str:
    return model if mode == "none" else f"{model} [{mode}]"


def not_learned(rows: list[dict]) -> set[tuple[str, str]]:
    """The (task, model) pairs whose mean accuracy at the training size without a mode is below :data:`LEARNED` %
    on some kind: they did not learn the task in the benchmark's budget (NoPE on the position tasks, by design)."""
    summary = _summary(rows)
    return {
        (task, model)
        for (task, _kind, model, mode, scale), (mean, *_rest) in summary.items()
        if mode == "none" and scale == 1.0 and mean < LEARNED
    }


def table_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, cells) of the results table: one row per task, kind, model and mode, one column per scale; a model
    that did not learn its task (:func:`not_learned`) is marked with :data:`NOT_LEARNED_MARK`."""
    summary = _summary(rows)
    unlearned = not_learned(rows)
    scales = sorted({float(r["scale"]) for r in rows})
    columns = ["task", "kind", "model"] + [f"{s:g}x" for s in scales]
    body = []
    for task in _ordered(rows, "task"):
        for kind in _ordered(rows, "kind"):
            for mode in _ordered(rows, "mode"):
                for model in _ordered(rows, "model"):
                    cells = [summary.get((task, kind, model, mode, s)) for s in scales]
                    if all(c is None for c in cells):
                        continue
                    text = [
                        "" if c is None else (f"{c[0]:.1f} ± {c[1]:.1f}" if c[2] > 1 else f"{c[0]:.1f}") for c in cells
                    ]
                    mark = f" {NOT_LEARNED_MARK}" if (task, model) in unlearned else ""
                    body.append([task, kind, _row_label(model, mode) + mark, *text])
    return columns, body


def count_bounds(rows: list[dict], kind: str, density: float) -> tuple[list[float], list[float]]:
    """The scales of the ``count`` rows of ``kind`` and the row-blind bound at each (%): a zoomed image is the
    training field, a canvas at scale k a field of k units (:func:`row_blind_count_accuracy`)."""
    scales = sorted({r["scale"] for r in rows if r["task"] == "count" and r["kind"] == kind})
    return scales, [100 * row_blind_count_accuracy(s if kind == "canvas" else 1.0, density) for s in scales]


def count_bound_note(rows: list[dict], density: float) -> str | None:
    """The row-blind bound of ``count`` at the sizes of ``rows`` (None without ``count`` rows): chance is 25 %, but a
    model that counts the grey objects of the whole image does better (:func:`row_blind_count_accuracy`)."""
    rows = [r for r in rows if r["task"] == "count"]
    if not rows:
        return None
    parts = []
    for kind in _ordered(rows, "kind"):
        scales, values = count_bounds(rows, kind, density)
        parts.append(
            f"{kind} " + ", ".join(f"{v:.1f}" for v in values) + f" % at {', '.join(f'{s:g}x' for s in scales)}"
        )
    return (
        "`count`: a model blind to rows can guess from the number of grey objects in the whole image; the best such "
        "guess scores " + "; ".join(parts) + " (dashed grey in the plot)."
    )


NOT_LEARNED_NOTE = (
    f"{NOT_LEARNED_MARK}: below {LEARNED:g} % at the training size without a mode: did not learn the task in this "
    "budget (the same protocol for every scheme; its accuracy beyond the training size says little)."
)


def _over_seeds(rows: list[dict]) -> str:
    """How the rows are summarised: "mean ± std over seeds 0, 1, 2", or "seed k" for a single seed."""
    seeds = sorted({int(r["seed"]) for r in rows})
    return f"mean ± std over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"


def _uses_modes(rows: list[dict]) -> bool:
    """Whether a row was evaluated with an extrapolation mode other than ``none`` (a ``[mode]`` row in the table)."""
    return any(r["mode"] != "none" for r in rows)


def markdown(rows: list[dict], title: str, img_size: int, density: float) -> str:
    samples = sorted({int(r["n"]) for r in rows})
    legend = " `[mode]`: the same weights evaluated with that extrapolation mode." if _uses_modes(rows) else ""
    lines = [
        f"# {title}",
        "",
        f"Top-1 accuracy (%), {_over_seeds(rows)}, on {'/'.join(map(str, samples))} scenes per task, kind, size and "
        f"seed; columns: test side in units of the training side ({img_size} px). Chance: 25 %.{legend}",
    ]
    note = count_bound_note(rows, density)
    if note:
        lines += ["", note]
    if not_learned(rows):
        lines += ["", NOT_LEARNED_NOTE]
    columns, body = table_rows(rows)
    for task in _ordered(rows, "task"):
        for kind in _ordered(rows, "kind"):
            lines += ["", f"## {task}, {kind}", "", "| model | " + " | ".join(columns[3:]) + " |"]
            lines.append("|---" * (len(columns) - 2) + "|")
            lines += ["| " + " | ".join(cells[2:]) + " |" for cells in body if cells[:2] == [task, kind]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str, density: float) -> None:
    """One panel per task (rows) and kind (columns): accuracy against scale, a colour per model, a line style per
    mode, error bars (std over seeds), chance as a dotted line; on ``count`` panels the row-blind bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = _summary(rows)
    tasks, kinds, models, modes = (_ordered(rows, f) for f in ("task", "kind", "model", "mode"))
    colours, styles = plot_palette(models, modes)
    fig, axes = plt.subplots(len(tasks), len(kinds), figsize=(5.2 * len(kinds), 3.4 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            for model in models:
                for mode in modes:
                    points = sorted((k[4], v) for k, v in summary.items() if k[:4] == (task, kind, model, mode))
                    if not points:
                        continue
                    xs = [p[0] for p in points]
                    ax.errorbar(
                        xs,
                        [p[1][0] for p in points],
                        yerr=[p[1][1] for p in points],
                        color=colours[model],
                        linestyle=styles.get(mode, "-"),
                        marker="o",
                        markersize=3,
                        capsize=2,
                        linewidth=1.2,
                    )
            ax.axhline(25.0, color="grey", linestyle=":", linewidth=0.8)
            if task == "count":
                ax.plot(*count_bounds(rows, kind, density), color="grey", linestyle="--", linewidth=0.9)
            ax.set_title(f"{task}, {kind}", fontsize=10)
            ax.set_xlabel("test side / training side")
            ax.set_ylabel("top-1 accuracy (%)")
            ax.set_ylim(0, 102)
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colours[m], marker="o", label=m) for m in models]
    handles += [plt.Line2D([], [], color="black", linestyle=styles.get(m, "-"), label=f"mode: {m}") for m in modes]
    handles.append(plt.Line2D([], [], color="grey", linestyle=":", label="chance"))
    if "count" in tasks:
        handles.append(plt.Line2D([], [], color="grey", linestyle="--", label="count: whole-image guess"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_report(rows: list[dict], out: Path, title: str, img_size: int, density: float) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "results.md", "csv": out / "results.csv", "png": out / "results.png"}
    _write_rows(paths["csv"], rows)
    paths["md"].write_text(markdown(rows, title, img_size, density))
    plot(rows, paths["png"], title, density)
    return paths


def table_notes(rows: list[dict], config: str | Path, img_size: int, density: float) -> list[str]:
    """The lines under the results table's header: what the numbers are, what ``[mode]`` means (only when a row was
    evaluated with a mode other than ``none``) and, with ``count`` rows, the row-blind bound of that task."""
    notes = [
        f"Top-1 accuracy (%), {_over_seeds(rows)}; config `{Path(config).as_posix()}`; columns: test side in units of "
        f"the training side ({img_size} px); chance 25 %; {'/'.join(str(n) for n in sorted({r['n'] for r in rows}))} "
        "scenes per task, kind, size and seed."
    ]
    if _uses_modes(rows):
        notes.append(
            "`[mode]`: the same weights evaluated with that extrapolation mode (`pi`: position interpolation)."
        )
    note = count_bound_note(rows, density)
    if note:
        notes.append(note)
    if not_learned(rows):
        notes.append(NOT_LEARNED_NOTE)
    return notes


def write_results_table(paths, rows, config, out_dir, name, command, img_size, density) -> tuple[Path, Path, Path]:
    """The table as ``<out_dir>/<name>.md`` and ``.csv`` through the benchmarks' shared writer (headed by the date,
    commit, versions, device and command), and the plot as ``<name>.png``. Every option of this script is a store
    action, so the command is recorded with each option where it is given last (a wrapper's default given again by
    the user appears once, as it ran)."""
    last_options, write_results = bench_results().last_options, bench_results().write_results
    columns, body = table_rows(rows)
    notes = table_notes(rows, config, img_size, density)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    md, csv_path = write_results(
        name, body, columns, out_dir=out_dir, command=last_options(command), notes=notes, device=device
    )
    png = Path(out_dir) / f"{name}.png"
    shutil.copyfile(paths["png"], png)
    return md, csv_path, png


def _train_and_evaluate_one(
    config: str | Path,
    task: str,
    seed: int,
    label: str,
    run_args: list[str],
    settings: dict,
    kinds: Sequence[str],
    sizes: Sequence[int],
    common: list[str],
    reuse: bool,
    verbose: bool,
) -> tuple[str, list[dict]]:
    """Train (or load) one (task, model, seed) and evaluate it: (its progress line, its evaluation rows)."""
    with contextlib.nullcontext() if verbose else quiet_lightning():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        run_dir = settings["out"] / task / label.replace(" ", "_") / f"seed{seed}"
        seed_args = [f"--seed_everything={seed}", f"--model.seed={seed}", f"--data.init_args.seed={seed}"]
        reused = run_dir / FINAL_CHECKPOINT if reuse and (run_dir / FINAL_CHECKPOINT).is_file() else None
        started = time.perf_counter()
        run_cmd = [*run_args, f"--data.init_args.task={task}", *seed_args, *common]
        model, datamodule = train_from_config(config, run_cmd, run_dir, reuse, not verbose)
        line = _trained_line(model, datamodule, started, reused)
        evaluated = run_dir / "eval.csv"
        wanted = {
            (k, s, m)
            for k in kinds
            for s in sizes
            for m in settings["extrapolation"]
            if accepts_extrapolation(model.model, m)
        }
        # --reuse keeps the rows evaluated before (with the loaded checkpoint, on as many scenes as now): a run
        # extended to more sizes, kinds or modes evaluates only the sets it lacks, and eval.csv keeps them all.
        previous = _read_rows(evaluated) if reused and evaluated.is_file() else []
        have = {(r["kind"], r["size"], r["mode"]): r for r in previous if r["n"] == datamodule.eval_samples}
        loaded = len(wanted & have.keys())
        modes = settings["extrapolation"]
        if loaded == len(wanted):
            line += ", evaluation loaded"
        else:
            started = time.perf_counter()
            new = evaluate(model, datamodule, task, label, seed, kinds, sizes, modes, device, skip=set(have))
            have.update({(r["kind"], r["size"], r["mode"]): r for r in new})
            _write_rows(evaluated, list(have.values()))
            line += f", {len(new)} sets evaluated in {_format_seconds(time.perf_counter() - started)}"
            line += f" ({loaded} loaded)" if loaded else ""
        found = [have[(k, s, m)] for k in kinds for s in sizes for m in modes if (k, s, m) in wanted]
        for row in found:
            row["model"] = label
        at_1x = [r["acc"] for r in found if r["size"] == datamodule.img_size and r["mode"] == "none"]
        return f"{line}; test at 1x {at_1x[0]:.1f} %", found


def run(
    config: str | Path,
    settings: dict,
    tasks: Sequence[str] = TASKS,
    kinds: Sequence[str] = KINDS,
    reuse: bool = False,
    verbose: bool = False,
    jobs: int = 1,
    threads: int | None = None,
) -> tuple[dict[str, Path], list[dict], dict]:
    """Train and evaluate every (task, model, seed); write the report under ``settings["out"]``. Returns the
    report's paths, the rows and the checked settings (``img_size``, ``density``, ``sizes``, ``runs``).

    ``jobs`` > 1 trains that many runs at once, each in a process of its own with ``threads`` torch threads
    (default: the cores divided by ``jobs``); the rows and the report are the same as with ``jobs=1``, in the same
    order, since every run is a function of its task, model and seed.
    """
    check_int(jobs, "jobs", min=1)
    threads = max(1, (os.cpu_count() or 1) // jobs) if threads is None else threads
    check_int(threads, "threads", min=1)
    with contextlib.nullcontext() if verbose else quiet_lightning():
        checked = check_arguments(config, settings, tasks, kinds)
    runs, sizes, out = checked["runs"], checked["sizes"], settings["out"]
    common = list(settings["overrides"])
    if not verbose:
        common = ["--trainer.enable_model_summary=false", *common]
    todo = [(task, seed, label, run_args) for task in tasks for seed in settings["seeds"] for label, run_args in runs]
    print(
        f"Training {len(runs)} model(s) x {len(tasks)} task(s) x {len(settings['seeds'])} seed(s) from {config}, "
        f"then evaluating at {' '.join(map(str, sizes))} px ({' and '.join(kinds)}; extrapolation: "
        f"{' '.join(settings['extrapolation'])}); output in {out}"
        + (f"; {jobs} jobs x {threads} thread(s)" if jobs > 1 else ""),
        flush=True,
    )
    shared = (settings, kinds, sizes, common, reuse, verbose)
    found: dict[int, list[dict]] = {}

    def report(index: int, line: str, rows: list[dict]) -> None:
        found[index] = rows
        task, seed, label, _ = todo[index]
        print(f"[{len(found)}/{len(todo)}] {task}, {label}, seed {seed}: {line}", flush=True)

    if jobs == 1:
        for index, (task, seed, label, run_args) in enumerate(todo):
            report(index, *_train_and_evaluate_one(config, task, seed, label, run_args, *shared))
    else:
        context = multiprocessing.get_context("spawn")
        one = (_train_and_evaluate_one.__module__, _train_and_evaluate_one.__name__)
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=set_worker_threads, initargs=(threads,)) as pool:
            futures = {
                pool.submit(call_by_name, *one, config, task, seed, label, run_args, *shared): index
                for index, (task, seed, label, run_args) in enumerate(todo)
            }
            try:
                for future in as_completed(futures):
                    report(futures[future], *future.result())
            except BaseException:
                pool.shutdown(cancel_futures=True)  # a failed run stops the queue; finished runs stay for --reuse
                raise
    rows = [row for index in range(len(todo)) for row in found[index]]
    title = "Scenes benchmark: extrapolation where position matters"
    return write_report(rows, out, title, checked["img_size"], checked["density"]), rows, checked


def main(argv: list[str] | None = None) -> dict[str, Path]:
    args = parse_args(argv)
    if args.quick:
        bench_results().print_quick_notice("--quick")
    settings = _settings(args)
    paths, rows, checked = run(
        args.config, settings, args.tasks, args.kinds, args.reuse, args.verbose, args.jobs, args.threads
    )
    print("\n" + paths["md"].read_text())
    where = [("table", paths["md"]), ("per-seed rows (CSV)", paths["csv"]), ("plot", paths["png"])]
    where.append(("checkpoints and logs", settings["out"] / "<task>" / "<model>" / "seed<k>"))
    if args.results is not None:
        command = sys.argv if argv is None else [__file__, *argv]
        md, csv_path, png = write_results_table(
            paths, rows, args.config, args.results, args.results_name, command, checked["img_size"], checked["density"]
        )
        paths.update(results_md=md, results_csv=csv_path, results_png=png)
        where += [("results table", md), ("results CSV", csv_path), ("results plot", png)]
    width = max(len(label) for label, _ in where)
    print("\n".join(f"{label + ':':<{width + 1}} {path}" for label, path in where))
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
