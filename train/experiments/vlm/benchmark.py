"""Multimodal extrapolation benchmark: train a tiny Qwen2-VL per (task, scheme, seed), evaluate it at every length.

Protocol (identical for every scheme): the model of :func:`~experiments.vlm.model.build_tiny_vlm`
(transformers' Qwen2-VL, hidden 64, 2 decoder layers, 4 heads of 16 dims, rope_theta 1e4, a one-block vision tower
of width 32 on 7-px patches, 2 x 2 merge), its position scheme set with ``apply_position_scheme``, trained from
scratch with Lightning on one task (AdamW, peak lr 2e-3, 50 warm-up steps then cosine, batch 32, gradient
clipping 1.0, loss on the answer token only), then evaluated on held-out digits at every evaluation length.
Every sample, the initialisation and the per-step scheme options are functions of the seed; all schemes of one
seed see the same training sequence and the same test questions.

Settings (:data:`SETTINGS`):

- ``quick``: rope_1d and mrope on the video needle, 250 steps, 100 questions at 8 and 16 frames. Used by the
  test suite; 45-60 s on 2 cores (39 s of CPU), about 90 % at 8 frames for both schemes.
- ``small``: every scheme x the 3 tasks (the 16 schemes of :data:`~experiments.vlm.schemes.BENCH_SCHEMES`;
  RoPE-DHR on the grid task only, see its ``not_applicable``); grid 2,500 steps, multi-image 1,500, video 600
  (batch 32 each, i.e. 80k, 48k and 19k training questions); 200 held-out questions per length; model as above
  (124k parameters, 35k of them in the vision tower).

Sizing, measured on the project's 2-core machine while other processes used most of it, so wall-clock times
were 2-3x the CPU times; CPU time is what a run takes on an idle core. One training run (one thread, Lightning
included): grid 2,500 steps 76-89 s CPU (30-35 ms per step), multi-image 1,500 steps 68 s (2,000 steps: 91 s),
video 600 steps 38-48 s; evaluation 1-6 s. So one seed of the first nine schemes is about 9 x 210 s = 1,900 s of
CPU, about 16 minutes with ``--jobs 2`` on an otherwise idle 2-core machine, and 3 seeds about 48 minutes. PPE's
merging costs more: its multi-image run took 112 s of CPU (1,500 steps).

Outputs (:func:`run_benchmark`): ``<out>/<task>.md`` (table, mean ± std over seeds), ``<task>.csv`` (one row per
task, scheme, seed and length), ``<task>.png`` (accuracy against length, one line per scheme, a band of ± one
std), plus ``runs.csv`` (time per run) and ``summary.md`` (all tables).
"""

from __future__ import annotations

import csv
import inspect
import json
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import lightning as L
import torch

from visionpe.training.evaluate import plot_palette, summarize

from ..sweep import set_worker_threads
from .data import VLMTaskDataModule
from .model import VLMSize
from .module import VLMModule
from .schemes import BENCH_SCHEMES, DEFAULT_SCHEMES
from .tasks import TASKS

__all__ = [
    "BenchSetting",
    "SETTINGS",
    "CHANCE",
    "get_setting",
    "train_and_evaluate",
    "run_benchmark",
    "check_trainer_args",
    "load_trainer_config",
    "write_task_report",
    "report_markdown",
    "markdown_table",
    "skipped_schemes",
]

CHANCE = 10.0  # % : ten digits


@dataclass(frozen=True)
class BenchSetting:
    """What one benchmark run trains and evaluates.

    ``steps`` per task; ``eval_lengths`` per task (missing tasks use the task's own, see
    :data:`~experiments.vlm.tasks.TASKS`); ``schemes`` and ``tasks`` are the defaults of
    :func:`run_benchmark`.
    """

    name: str
    steps: dict[str, int]
    schemes: tuple[str, ...]
    tasks: tuple[str, ...]
    size: VLMSize = field(default_factory=VLMSize)
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 50
    eval_samples: int = 200
    eval_batch_size: int = 100
    eval_lengths: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def lengths(self, task: str) -> tuple[int, ...]:
        return tuple(self.eval_lengths.get(task, TASKS[task].eval_lengths))


SETTINGS: dict[str, BenchSetting] = {
    "quick": BenchSetting(
        "quick",
        steps={"grid": 250, "multi_image": 250, "video": 250},
        schemes=("rope_1d", "mrope"),
        tasks=("video",),
        warmup_steps=25,
        eval_samples=100,
        eval_lengths={"grid": (3, 6), "multi_image": (4, 16), "video": (8, 16)},
    ),
    "small": BenchSetting(
        "small",
        steps={"grid": 2500, "multi_image": 1500, "video": 600},
        schemes=DEFAULT_SCHEMES,
        tasks=tuple(TASKS),
    ),
}


def get_setting(setting: str | BenchSetting) -> BenchSetting:
    """``setting`` itself, or the entry of :data:`SETTINGS` with that name."""
    if isinstance(setting, BenchSetting):
        return setting
    if not isinstance(setting, str) or setting not in SETTINGS:
        raise ValueError(f"setting must be one of {sorted(SETTINGS)} or a BenchSetting, got {setting!r}")
    return SETTINGS[setting]


@contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-run banners and hints for the duration of one run (restored afterwards)."""
    loggers = [logging.getLogger(name) for name in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(LeafSpec|does not have many workers|litlogger).*")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def train_and_evaluate(
    task: str,
    scheme: str,
    seed: int,
    setting: str | BenchSetting = "small",
    log_dir: str | Path | None = None,
    trainer_args: Mapping[str, Any] | None = None,
) -> list[dict]:
    """Train one model with Lightning and evaluate it at every length of the setting.

    Args:
        task: ``grid``, ``multi_image`` or ``video``.
        scheme: a name from :data:`~experiments.vlm.schemes.BENCH_SCHEMES`.
        seed: seed of the data, the initialisation and the scheme's option draws.
        setting: a name from :data:`SETTINGS` or a :class:`BenchSetting`.
        log_dir: when given, Lightning's CSV log of the training loss and accuracy goes there.
        trainer_args: ``lightning.Trainer`` arguments in place of the default ``accelerator="cpu", devices=1``
            (``accelerator``, ``devices``, ``precision``, ``strategy``...; see :func:`check_trainer_args`), e.g.
            the ``trainer`` section of ``configs/fsdp/vlm.yaml`` (:func:`load_trainer_config`).

    Returns:
        One row per evaluation length: ``task, scheme, seed, length, acc`` (accuracy in %), ``n`` (questions),
        ``train_length`` (whether the length was in the training range), ``steps``, ``train_s`` (wall-clock),
        ``train_cpu_s`` (CPU time of this process: the wall-clock time on an otherwise idle core), ``eval_s``.
    """
    setting = get_setting(setting)
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    if scheme not in BENCH_SCHEMES:
        raise ValueError(f"scheme must be one of {list(BENCH_SCHEMES)}, got {scheme!r}")
    if not BENCH_SCHEMES[scheme].applies_to(task):
        raise ValueError(
            f"scheme {scheme!r} does not apply to task {task!r}: {BENCH_SCHEMES[scheme].not_applicable[task]}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if task not in setting.steps:
        raise ValueError(f"setting {setting.name!r} has no steps for task {task!r}: steps = {setting.steps}")
    trainer_args = check_trainer_args(trainer_args)
    with _quiet_lightning():
        return _train_and_evaluate(task, scheme, seed, setting, log_dir, trainer_args)


_TRAINER_ARGS = frozenset(inspect.signature(L.Trainer).parameters)
# Trainer arguments the benchmark sets itself: its protocol (steps, clipping, no validation) and its outputs.
_OWN_TRAINER_ARGS = (
    "max_steps",
    "logger",
    "log_every_n_steps",
    "enable_checkpointing",
    "enable_progress_bar",
    "enable_model_summary",
    "gradient_clip_val",
    "limit_val_batches",
    "num_sanity_val_steps",
)


def check_trainer_args(trainer_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """``trainer_args`` as a dict, its ``strategy`` instantiated when it is a ``{"class_path", "init_args"}`` mapping
    (as a LightningCLI config writes it), after checking every key is a ``lightning.Trainer`` argument that the
    benchmark does not set itself (its protocol: ``max_steps``, ``gradient_clip_val``, no validation; its logs).

    Raises:
        TypeError: ``trainer_args`` is not a mapping (or None), or ``strategy`` is a mapping whose class does not
            instantiate from its ``init_args``.
        ValueError: a key is no Trainer argument, or one the benchmark owns, or ``strategy`` lacks ``class_path``.
    """
    if trainer_args is None:
        return {}
    if not isinstance(trainer_args, Mapping):
        raise TypeError(
            f"trainer_args must be a mapping of lightning.Trainer arguments or None, got {type(trainer_args).__name__}"
        )
    for key in trainer_args:
        if key in _OWN_TRAINER_ARGS:
            raise ValueError(f"trainer_args cannot set {key!r}: the benchmark's protocol sets it (to compare runs)")
        if key not in _TRAINER_ARGS:
            raise ValueError(f"trainer_args has {key!r}, which is no lightning.Trainer argument")
    args = dict(trainer_args)
    strategy = args.get("strategy")
    if isinstance(strategy, Mapping):
        if "class_path" not in strategy:
            raise ValueError(
                f"trainer_args strategy must be a name, a Strategy or a class_path mapping, got {strategy}"
            )
        from lightning.pytorch.cli import instantiate_class

        try:
            args["strategy"] = instantiate_class((), dict(strategy))
        except (ImportError, AttributeError, TypeError) as err:
            raise TypeError(f"trainer_args strategy {strategy['class_path']!r} does not instantiate: {err}") from err
    return args


def load_trainer_config(path: str | Path) -> dict[str, Any]:
    """The ``trainer`` section of a YAML file (a LightningCLI config such as ``configs/fsdp/vlm.yaml``) as written
    (a ``strategy`` mapping stays one: each run builds its own), after :func:`check_trainer_args` accepted it.
    ValueError when the file has no ``trainer`` mapping."""
    import yaml

    config = yaml.safe_load(Path(path).read_text())
    section = config.get("trainer") if isinstance(config, dict) else None
    if not isinstance(section, dict):
        raise ValueError(f"{path} must hold a 'trainer' mapping of lightning.Trainer arguments, got {section!r}")
    check_trainer_args(section)
    return section


def _train_and_evaluate(
    task: str, scheme: str, seed: int, setting: BenchSetting, log_dir: str | Path | None, trainer_args: dict
) -> list[dict]:
    steps = setting.steps[task]
    L.seed_everything(seed, verbose=False)
    datamodule = VLMTaskDataModule(
        task,
        scheme,
        batch_size=setting.batch_size,
        num_train_samples=steps * setting.batch_size,
        num_eval_samples=setting.eval_samples,
        eval_lengths=setting.lengths(task),
        eval_batch_size=setting.eval_batch_size,
        seed=seed,
    )
    module = VLMModule(
        scheme,
        setting.size,
        lr=setting.lr,
        warmup_steps=min(setting.warmup_steps, steps - 1),
        max_steps=steps,
        eval_lengths=datamodule.eval_lengths,
        seed=seed,
    )
    logger = False
    if log_dir is not None:
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(Path(log_dir), name=f"{task}_{scheme}", version=f"seed{seed}")
    trainer = L.Trainer(
        **({"accelerator": "cpu", "devices": 1} | trainer_args),
        max_steps=steps,
        logger=logger,
        log_every_n_steps=max(1, min(50, steps // 10)),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    start, start_cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, datamodule=datamodule)
    trained, trained_cpu = time.perf_counter(), time.process_time()
    results = trainer.test(module, datamodule=datamodule, verbose=False)
    done = time.perf_counter()
    metrics = {k: float(v) for result in results for k, v in result.items()}
    train_max = max(TASKS[task].train_lengths)
    return [
        {
            "task": task,
            "scheme": scheme,
            "seed": seed,
            "length": length,
            "acc": 100.0 * metrics[f"test/acc@{length}"],
            "n": setting.eval_samples,
            "train_length": length <= train_max,
            "steps": steps,
            "train_s": round(trained - start, 2),
            "train_cpu_s": round(trained_cpu - start_cpu, 2),
            "eval_s": round(done - trained, 2),
        }
        for length in datamodule.eval_lengths
    ]


def _length_label(task: str, length: int) -> str:
    return {"grid": f"{length}x{length}", "multi_image": f"K={length}", "video": f"{length} fr"}[task]


def _summarize(rows: Iterable[dict]) -> dict[str, dict[int, tuple[float, float, int]]]:
    """{scheme: {length: (mean, std, n_seeds)}} in order of first appearance; std is 0 for one seed."""
    return summarize(rows, group="scheme", by="length")


def skipped_schemes(task: str, schemes: Iterable[str]) -> list[str]:
    """The schemes among ``schemes`` that do not apply to ``task`` (not run; their table row says so)."""
    return [s for s in schemes if not BENCH_SCHEMES[s].applies_to(task)]


def markdown_table(task: str, rows: Sequence[dict], skipped: Sequence[str] = ()) -> str:
    """Accuracy table of one task: a row per scheme, a column per length (``*`` = within the training
    range), and the mean over the lengths beyond training; mean ± std over seeds when there are several.
    ``skipped``: schemes that do not apply to the task, one row each marked ``‡`` with "not run" in every cell."""
    summary = _summarize(rows)
    lengths = sorted({int(r["length"]) for r in rows})
    train_max = max(TASKS[task].train_lengths)
    beyond = [n for n in lengths if n > train_max]
    header = [_length_label(task, n) + ("*" if n <= train_max else "") for n in lengths]
    if beyond:
        header.append("mean beyond training")
    lines = ["| scheme | " + " | ".join(header) + " |", "|---" + "|---:" * len(header) + "|"]

    def cell(mean: float, std: float, n: int) -> str:
        return f"{mean:.1f} ± {std:.1f}" if n > 1 else f"{mean:.1f}"

    for scheme, by_length in summary.items():
        cells = [cell(*by_length[n]) if n in by_length else "–" for n in lengths]
        if beyond:
            per_seed: dict[int, list[float]] = {}
            for row in rows:
                if row["scheme"] == scheme and int(row["length"]) in beyond:
                    per_seed.setdefault(int(row["seed"]), []).append(float(row["acc"]))
            means = [statistics.fmean(v) for v in per_seed.values()]
            cells.append(cell(statistics.fmean(means), statistics.stdev(means) if len(means) > 1 else 0.0, len(means)))
        note = "†" if task == "video" and BENCH_SCHEMES[scheme].video_as_images else ""
        lines.append(f"| {scheme}{note} | " + " | ".join(cells) + " |")
    for scheme in skipped:
        lines.append(f"| {scheme}‡ | " + " | ".join(["not run"] * len(header)) + " |")
    return "\n".join(lines)


def report_markdown(task: str, rows: Sequence[dict], skipped: Sequence[str] = ()) -> str:
    """The Markdown report of one task: title, protocol line, table (:func:`markdown_table`) and its notes."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    rows = [r for r in rows if r["task"] == task]
    if not rows:
        raise ValueError(f"rows hold no result for task {task!r}")
    unknown = [s for s in skipped if s not in BENCH_SCHEMES or BENCH_SCHEMES[s].applies_to(task)]
    if unknown:
        raise ValueError(f"skipped must name schemes that do not apply to task {task!r}, got {unknown}")
    spec = TASKS[task]
    seeds = sorted({int(r["seed"]) for r in rows})
    n = rows[0]["n"]
    notes = [
        f"# {spec.description}",
        "",
        f"Accuracy (%) of the answer digit on held-out digits, {n} questions per length and seed, "
        + (f"mean ± std over seeds {seeds}" if len(seeds) > 1 else f"seed {seeds[0]}")
        + f"; chance {CHANCE:.0f} %. `*`: within the training range.",
        "",
        markdown_table(task, rows, skipped),
    ]
    if task == "video" and any(BENCH_SCHEMES[r["scheme"]].video_as_images for r in rows):
        notes += ["", "† Circle-RoPE is defined for images: its frames are given as consecutive images."]
    for scheme in skipped:
        notes += ["", f"‡ {scheme} is not run on this task: {BENCH_SCHEMES[scheme].not_applicable[task]}."]
    return "\n".join(notes) + "\n"


def write_task_report(
    task: str, rows: Sequence[dict], out_dir: str | Path, skipped: Sequence[str] = ()
) -> dict[str, Path]:
    """Write ``<task>.md`` (:func:`report_markdown`), ``<task>.csv`` and ``<task>.png`` under ``out_dir``; return
    their paths. ``skipped``: schemes that do not apply to the task (a "not run" row and a note in the table)."""
    text = report_markdown(task, rows, skipped)
    rows = [r for r in rows if r["task"] == task]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / f"{task}.{kind}" for kind in ("md", "csv", "png")}
    paths["md"].write_text(text)
    fields = ["task", "scheme", "seed", "length", "acc", "n", "train_length", "steps", "train_s", "eval_s"]
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: r[k] for k in fields} for r in rows)

    plot_task(task, rows, paths["png"])
    return paths


def plot_task(task: str, rows: Sequence[dict], path: str | Path) -> Path:
    """Plot accuracy against evaluation length for ``task``: one line per scheme of ``rows`` (the rows of other tasks
    are ignored), a band of ± one standard deviation over seeds, the largest training length dotted and chance
    dashed; 1-D RoPE (the baseline) black and dashed, the other schemes solid, one colour each (``plot_palette``).
    Returns ``path``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    rows = [r for r in rows if r["task"] == task]
    if not rows:
        raise ValueError(f"rows must hold at least one row of task {task!r}, got none")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = TASKS[task]
    seeds = sorted({int(r["seed"]) for r in rows})
    path = Path(path)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    summary = _summarize(rows)
    colours, _ = plot_palette([scheme for scheme in summary if scheme != "rope_1d"])  # one colour per design
    for scheme, by_length in summary.items():
        lengths = list(by_length)
        means = [by_length[x][0] for x in lengths]
        stds = [by_length[x][1] for x in lengths]
        style, color = ("--", "black") if scheme == "rope_1d" else ("-", colours[scheme])
        ax.plot(lengths, means, style, marker="o", color=color, label=scheme)
        ax.fill_between(
            lengths,
            [m - s for m, s in zip(means, stds, strict=True)],
            [m + s for m, s in zip(means, stds, strict=True)],
            color=color,
            alpha=0.15,
            linewidth=0,
        )
    all_lengths = sorted({int(r["length"]) for r in rows})
    ax.axvline(max(spec.train_lengths), color="grey", linestyle=":", linewidth=1)
    ax.axhline(CHANCE, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(all_lengths, [_length_label(task, x) for x in all_lengths])
    ax.set_xlabel(f"evaluation length ({spec.length_label}); dotted: largest training length")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(spec.description + (f" (seeds {seeds})" if len(seeds) > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _load_result(path: Path, setting: BenchSetting) -> list[dict] | None:
    """The rows of a run saved by an earlier :func:`run_benchmark` call with the same setting, else None."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("setting") != setting.name or not saved.get("rows"):
        return None
    return saved["rows"]


def run_benchmark(
    setting: str | BenchSetting = "quick",
    schemes: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None,
    seeds: Sequence[int] = (0,),
    out_dir: str | Path = "runs/vlm_extrapolation",
    jobs: int = 1,
    threads: int | None = None,
    log: Callable[[str], None] | None = print,
    reuse: bool = False,
    trainer_args: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Path]]:
    """Train and evaluate every (task, scheme, seed), then write the per-task reports.

    Args:
        setting: ``"quick"``, ``"small"`` or a :class:`BenchSetting`.
        schemes, tasks: subsets; default the setting's.
        seeds: one model per seed and (task, scheme).
        out_dir: the run folder.
        jobs: runs trained at the same time, each in its own process (``jobs=2`` with one thread each is the
            fastest use of 2 cores for these small models); 1 runs everything in this process. With
            ``jobs > 1`` the workers are spawned, so a calling script needs ``if __name__ == "__main__":``.
        threads: torch threads per run; default ``max(1, cpu_count // jobs)``.
        log: called with one progress line per finished run and with the tables; None for silence.
        reuse: every finished run is saved as ``<out_dir>/results/<task>_<scheme>_seed<seed>.json``; with
            ``reuse``, runs saved there by an earlier call (same setting) are loaded instead of trained again,
            so an interrupted benchmark continues where it stopped.
        trainer_args: ``lightning.Trainer`` arguments for every run (:func:`train_and_evaluate`), e.g. from
            :func:`load_trainer_config`; a ``strategy`` mapping is instantiated in each run.

    Returns:
        {task: {"md": path, "csv": path, "png": path}} of every task with a run; ``out_dir`` also gets ``runs.csv``
        (time per run) and ``summary.md``. A (task, scheme) to which the scheme does not apply
        (:meth:`~experiments.vlm.schemes.BenchScheme.applies_to`) is not run, and the task's table says so.
    """
    setting = get_setting(setting)
    schemes = list(setting.schemes if schemes is None else schemes)
    tasks = list(setting.tasks if tasks is None else tasks)
    if isinstance(schemes, str) or not schemes or any(s not in BENCH_SCHEMES for s in schemes):
        raise ValueError(f"schemes must be a non-empty list of {list(BENCH_SCHEMES)}, got {schemes!r}")
    if not tasks or any(t not in TASKS for t in tasks):
        raise ValueError(f"tasks must be a non-empty list of {sorted(TASKS)}, got {tasks!r}")
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of non-negative ints, got {seeds!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    threads = max(1, (os.cpu_count() or 1) // jobs) if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    check_trainer_args(trainer_args)  # before anything trains; each run builds its own strategy from a mapping
    log = log or (lambda line: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [
        (task, scheme, seed)
        for seed in seeds
        for task in tasks
        for scheme in schemes
        if BENCH_SCHEMES[scheme].applies_to(task)
    ]
    for task in tasks:
        for scheme in skipped_schemes(task, schemes):
            log(f"{task} {scheme}: not run, {BENCH_SCHEMES[scheme].not_applicable[task]}")
    results_dir = out_dir / "results"
    results_dir.mkdir(exist_ok=True)

    def result_path(run: tuple[str, str, int]) -> Path:
        return results_dir / f"{run[0]}_{run[1]}_seed{run[2]}.json"

    rows: list[dict] = []
    todo = []
    for run in runs:
        saved = _load_result(result_path(run), setting) if reuse else None
        if saved is None:
            todo.append(run)
        else:
            rows += saved
    log(
        f"{len(runs)} runs ({setting.name} setting: {len(tasks)} tasks x {len(schemes)} schemes x {len(seeds)} "
        f"seeds, the combinations that apply), {len(runs) - len(todo)} of them loaded from an earlier call, "
        f"{jobs} job(s) x {threads} thread(s), output in {out_dir}"
    )
    start = time.perf_counter()

    def report(done: int, result: list[dict]) -> None:
        first = result[0]
        path = result_path((first["task"], first["scheme"], first["seed"]))
        partial = path.with_suffix(".partial")  # a run killed mid-write leaves no half-written result behind
        partial.write_text(json.dumps({"setting": setting.name, "rows": result}, indent=1))
        partial.replace(path)
        accs = " | ".join(f"{_length_label(r['task'], r['length'])} {r['acc']:.1f}" for r in result)
        log(
            f"[{done}/{len(todo)}] {first['task']} {first['scheme']} seed {first['seed']}: {accs} "
            f"(train {first['train_s']:.0f} s, {first['train_cpu_s']:.0f} s CPU; eval {first['eval_s']:.0f} s; "
            f"{time.perf_counter() - start:.0f} s total)"
        )

    if jobs == 1:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for i, run in enumerate(todo, 1):
                result = train_and_evaluate(*run, setting=setting, log_dir=out_dir / "logs", trainer_args=trainer_args)
                rows += result
                report(i, result)
        finally:
            torch.set_num_threads(previous)
    else:
        context = get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=set_worker_threads, initargs=(threads,)) as pool:
            futures = [
                pool.submit(
                    train_and_evaluate, *run, setting=setting, log_dir=out_dir / "logs", trainer_args=trainer_args
                )
                for run in todo
            ]
            for i, future in enumerate(as_completed(futures), 1):
                result = future.result()
                rows += result
                report(i, result)
    order = {(t, s, seed): i for i, (t, s, seed) in enumerate(runs)}
    rows.sort(key=lambda r: (order[(r["task"], r["scheme"], r["seed"])], r["length"]))
    with (out_dir / "runs.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "scheme", "seed", "steps", "train_s", "train_cpu_s", "eval_s"])
        writer.writeheader()
        for run in runs:
            first = next(r for r in rows if (r["task"], r["scheme"], r["seed"]) == run)
            writer.writerow({k: first[k] for k in writer.fieldnames})
    paths, tables = {}, []
    for task in tasks:
        if not any(r["task"] == task for r in rows):
            continue  # no requested scheme applies to this task (logged above)
        paths[task] = write_task_report(task, rows, out_dir, skipped_schemes(task, schemes))
        tables.append(paths[task]["md"].read_text())
    (out_dir / "summary.md").write_text("\n".join(tables))
    log("\n" + "\n".join(tables))
    log(f"done in {time.perf_counter() - start:.0f} s; tables, CSVs and plots in {out_dir}")
    return paths
