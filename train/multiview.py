r"""Why camera-aware encodings matter: small multi-view ViTs trained on a task that needs the cameras, then tested on
the same scenes with the world moved.

The task (:mod:`experiments.multiview`, ``--label match``): two 32 px views of three balls, drawn as disks of one
pixel size at any depth, in colour in view 0 and all grey in view 1; the label is the colour of the ball that is
leftmost in view 1, which needs the correspondence between the views, i.e. their relative pose (``--label
nearest``: the colour of the ball nearest to camera 0). Every scheme of ``--schemes`` (camera schemes, ``none`` for
a model without cameras) is trained for ``--steps`` steps on fresh scenes per seed, then evaluated on
``--eval-samples`` held-out scenes (a fixed seed) twice:

- ``held-out``: the scenes as drawn, in the world frame of training (cameras around the origin, world +y up);
- ``moved``: the same images and labels with every camera moved by one random rigid motion of the world per scene
  (a uniformly random rotation and a translation with std 5 per axis, several scene radii,
  :meth:`MultiViewTask.move_world`), which training never showed. Relative encodings give the same logits by
  construction; absolute ones see new 3D inputs. ``same prediction``: the share of scenes predicted alike in both.

    python train/multiview.py                                   # every camera scheme and none, seeds 0 1 2
    python train/multiview.py --schemes none gta --seeds 0      # a subset
    python train/multiview.py --results docs/benchmarks/results # also the documentation's table, CSV and plot
    python train/multiview.py --quick                           # a smoke run (seconds), not a measurement

Output: a line per trained model, then the table (mean ± std over seeds per scheme and condition, the drop and the
share of unchanged predictions); per run ``<out>/<scheme>/seed<k>/result.json`` and ``model.pt``, reused with
``--reuse`` when their settings match; ``<out>/multiview.{md,csv,png}``, and with ``--results DIR`` the same as
``DIR/multiview.{md,csv,png}``, headed by the date, commit, versions, device and command (``bench/results.py``);
``--quick`` says in one line that its numbers measure nothing, and its ``--results`` may be any folder but the
published ``docs/benchmarks/results``.
The CSV has one row per scheme, seed and condition. Runs are independent and deterministic per seed: ``--jobs``
(default 2) train that many at once in forked processes, each on ``--threads`` CPU threads (default 1; on a shared
2-core machine, two threads per process made every step several times slower). Importable: ``from multiview import
main``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import timm
import torch

import visionpe
from experiments.multiview import LABELS, MultiViewTask
from experiments.sweep import bench_results
from visionpe.camera import Cameras, RelativeCameraEncoding
from visionpe.registry import get_scheme_class

NAME = "multiview"
CONDITIONS = ("held-out", "moved")
EVAL_SEED = 2**31 - 1  # the held-out scenes; training draws from the run's seed
MOVE_SEED = 2**31 - 2  # the rigid motions of the moved condition
MOVE_TRANSLATION = 5.0  # std of each translation component of the world's motion (the balls lie within ~1.5)

#: the model every scheme gets: two 32 px views in 4x4 patches of 8 px (32 tokens), width 64, depth 4, 4 heads, and
#: max pooling over the tokens (with the average, the few tokens that hold a ball are diluted by the black ones; in
#: trials, models pooled so stayed at chance for hundreds of steps even on a label that view 0 alone gives)
MODEL = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 4, "global_pool": "max"}
#: the within-view encoding of every model (the baseline's only position information)
POS_EMBED = "sincos"

#: options that tell a scheme the scale of these scenes (cameras 5-6 units from the origin, balls within ~1.5 of
#: it); the rest are each scheme's defaults
SCHEME_OPTIONS: dict[str, dict] = {
    # 6DoF on P = w2c, whose translation (5-6 units) would otherwise dominate the logits
    "cape": {"translation_scale": 0.2},
    # head_dim 16 takes one ray per patch (12 turned channels); the depth head starts at the scene's depth
    "rayrope": {"num_rays": 1, "encoded_dim": 12, "init_log_depth": math.log(5.5)},
    # the scene box around the origin, depth bins over the depths where the balls are
    "petr": {"position_range": (-3, -3, -3, 3, 3, 3), "depth_start": 3.0, "depth_max": 8.0, "num_bins": 16},
    "3dppe": {"position_range": (-3, -3, -3, 3, 3, 3), "depth_start": 3.0, "depth_max": 8.0},
}

DEFAULTS = {"steps": 1000, "batch_size": 64, "eval_samples": 2000, "lr": 3e-3, "jobs": 2}
QUICK = {"steps": 3, "batch_size": 8, "eval_samples": 32, "jobs": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--schemes", nargs="+", default=None, help="camera schemes and/or none (default: every camera scheme, none)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="training seeds (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULTS['steps']})")
    parser.add_argument("--batch-size", type=int, default=None, help=f"default {DEFAULTS['batch_size']}")
    parser.add_argument("--lr", type=float, default=None, help=f"AdamW peak learning rate (default {DEFAULTS['lr']})")
    parser.add_argument(
        "--eval-samples", type=int, default=None, help=f"held-out scenes (default {DEFAULTS['eval_samples']})"
    )
    parser.add_argument(
        "--label", default="match", choices=LABELS, help="match (default) or nearest (experiments.multiview)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="runs trained at once, in forked processes (default 2; --quick: 1)"
    )
    parser.add_argument("--out", default="runs/multiview", help="folder of the runs, table, CSV and plot")
    parser.add_argument("--reuse", action="store_true", help="load finished runs with the same settings from --out")
    parser.add_argument("--results", default=None, help="also write multiview.{md,csv,png} there with the header")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run in seconds: 3 steps of 8 scenes, 32 eval scenes, seed 0, one process (unless given)",
    )
    args = parser.parse_args(argv)
    # --quick writes --results where it is told (its tests), never into the published folder
    error = bench_results().output_error(args.out, args.results, "--quick" if args.quick else None, quick_results=True)
    if error:
        parser.error(error)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK.get(key, value) if args.quick else value)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    return args


def check_args(args: argparse.Namespace) -> list[str]:
    """ValueError on arguments that cannot run (before anything trains); returns the schemes in order."""
    cameras = visionpe.list_schemes("camera")
    schemes = args.schemes if args.schemes is not None else [*cameras, "none"]
    unknown = [s for s in schemes if s != "none" and s not in cameras]
    if unknown:
        raise ValueError(f"--schemes must be camera schemes ({', '.join(cameras)}) or none, got {unknown}")
    for name, values in (("--schemes", schemes), ("--seeds", args.seeds)):
        repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
        if repeated:
            raise ValueError(f"{name} must not repeat values, got {repeated} more than once in {values}")
    if any(seed < 0 for seed in args.seeds):
        raise ValueError(f"--seeds must be non-negative ints, got {args.seeds}")
    for name in ("steps", "batch_size", "eval_samples", "threads", "jobs"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    return schemes


def kind(scheme: str) -> str:
    """``relative``, ``absolute`` or ``none`` (no camera information)."""
    if scheme == "none":
        return "none"
    return "relative" if issubclass(get_scheme_class(scheme), RelativeCameraEncoding) else "absolute"


def build_model(scheme: str, task: MultiViewTask) -> torch.nn.Module:
    """The multi-view ViT of :data:`MODEL` with ``scheme`` between views (``none``: no camera input)."""
    return timm.create_model(
        "visionpe_mvvit_tiny_patch16",
        camera_embed=None if scheme == "none" else scheme,
        camera_embed_kwargs=SCHEME_OPTIONS.get(scheme),
        pos_embed=POS_EMBED,
        num_views=task.num_views,
        num_classes=task.num_classes,
        **MODEL,
    )


def warmup_cosine(steps: int, warmup_fraction: float = 0.1):
    """The learning-rate factor of step s: linear warm-up over the first ``warmup_fraction`` of the steps, then a
    cosine to 0."""
    warmup = max(1, round(warmup_fraction * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


def train(scheme: str, seed: int, task: MultiViewTask, args: argparse.Namespace) -> torch.nn.Module:
    """``args.steps`` AdamW steps on fresh scenes drawn from ``seed``; the model initialised from ``seed``."""
    torch.manual_seed(seed)
    model = build_model(scheme, task)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(args.steps):
        batch = task.sample(args.batch_size, generator)
        loss = torch.nn.functional.cross_entropy(model(batch.images, batch.cameras), batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return model.eval()


def eval_sets(task: MultiViewTask, samples: int) -> dict[str, tuple]:
    """The held-out scenes and their moved cameras: {condition: (images, cameras, labels)}."""
    batch = task.sample(samples, torch.Generator().manual_seed(EVAL_SEED))
    moved = task.move_world(batch.cameras, torch.Generator().manual_seed(MOVE_SEED), MOVE_TRANSLATION)
    return {"held-out": (batch.images, batch.cameras, batch.labels), "moved": (batch.images, moved, batch.labels)}


@torch.no_grad()
def predict(model: torch.nn.Module, images: torch.Tensor, cameras: Cameras, chunk: int = 500) -> torch.Tensor:
    """(B,) predicted classes, ``chunk`` samples at a time."""
    out = []
    for start in range(0, len(images), chunk):
        part = slice(start, start + chunk)
        cams = Cameras(cameras.w2c[part], cameras.intrinsics[part], cameras.image_size)
        out.append(model(images[part], cams).argmax(-1))
    return torch.cat(out)


def evaluate(model: torch.nn.Module, evals: dict) -> dict[str, float]:
    """Top-1 accuracy in % per condition, and ``agreement``: the % of scenes whose prediction is the same for the
    held-out and the moved cameras (100 for a model that ignores where the world frame is)."""
    preds = {condition: predict(model, images, cameras) for condition, (images, cameras, _) in evals.items()}
    labels = evals["held-out"][2]
    scores = {condition: 100.0 * float((pred == labels).float().mean()) for condition, pred in preds.items()}
    scores["agreement"] = 100.0 * float((preds["held-out"] == preds["moved"]).float().mean())
    return scores


def settings(scheme: str, task: MultiViewTask, args: argparse.Namespace) -> dict:
    """What a run's result depends on (``--reuse`` takes a saved run only when these match)."""
    return {
        "scheme": scheme,
        "scheme_options": SCHEME_OPTIONS.get(scheme, {}),
        "pos_embed": POS_EMBED,
        "model": MODEL,
        "task": asdict(task),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "eval_samples": args.eval_samples,
        "move_translation": MOVE_TRANSLATION,
    }


_EVAL_CACHE: dict[tuple, dict] = {}


def run_one(scheme: str, seed: int, args: argparse.Namespace) -> dict:
    """Train (or with ``--reuse`` load) one run and return its record: accuracy per condition, wall time."""
    torch.set_num_threads(args.threads)
    task = MultiViewTask(label=args.label)
    key = (args.label, args.eval_samples)
    if key not in _EVAL_CACHE:  # drawn once per process
        _EVAL_CACHE[key] = eval_sets(task, args.eval_samples)
    evals = _EVAL_CACHE[key]
    folder = Path(args.out) / scheme / f"seed{seed}"
    record_path = folder / "result.json"
    wanted = json.loads(json.dumps(settings(scheme, task, args)))  # tuples as lists, as the saved JSON has them
    if args.reuse and record_path.is_file():
        record = json.loads(record_path.read_text())
        if record.get("settings") == wanted:
            print(f"{scheme:>8} seed {seed}: reused {record_path}", flush=True)
            return record
    start = time.time()
    model = train(scheme, seed, task, args)
    seconds = time.time() - start
    acc = evaluate(model, evals)
    record = {"scheme": scheme, "seed": seed, "accuracy": acc, "train_seconds": seconds, "settings": wanted}
    record["commit"] = bench_results().git_commit()  # the code this run was trained with
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pt")
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    scores = ", ".join(f"{c} {a:.1f} %" for c, a in acc.items())  # held-out, moved, agreement
    print(f"{scheme:>8} seed {seed}: {scores} ({seconds:.0f} s training)", flush=True)
    return record


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.1f} ± {std:.1f}"


def summary_rows(records: list[dict], schemes: list[str]) -> list[list]:
    """One row per scheme: kind, accuracy per condition, the drop (held-out - moved) and the share of unchanged
    predictions, mean ± std over seeds."""
    rows = []
    for scheme in schemes:
        runs = [r for r in records if r["scheme"] == scheme]
        by = {c: [r["accuracy"][c] for r in runs] for c in (*CONDITIONS, "agreement")}
        drop = [r["accuracy"]["held-out"] - r["accuracy"]["moved"] for r in runs]
        rows.append([scheme, kind(scheme), *(_mean_std(by[c]) for c in CONDITIONS), _mean_std(drop)])
        rows[-1].append(_mean_std(by["agreement"]))
    return rows


SUMMARY_COLUMNS = ["scheme", "kind", "held-out (%)", "moved world (%)", "drop (points)", "same prediction (%)"]
SEED_COLUMNS = ["scheme", "kind", "seed", "condition", "accuracy (%)", "same prediction (%)", "train seconds"]


def seed_rows(records: list[dict]) -> list[list]:
    """One row per scheme, seed and condition; ``same prediction``: the % of scenes predicted as on the held-out
    cameras (100 for the held-out condition itself)."""
    rows = []
    for r in records:
        for condition in CONDITIONS:
            same = 100.0 if condition == "held-out" else r["accuracy"]["agreement"]
            rows.append([r["scheme"], kind(r["scheme"]), r["seed"], condition, r["accuracy"][condition], same])
            rows[-1].append(r["train_seconds"])
    return rows


#: the question each label asks, as the plot's title
QUESTIONS = {
    "match": "Which colour is the leftmost ball of the grey view 1?",
    "nearest": "Which ball is nearest to camera 0?",
}


def plot(records: list[dict], schemes: list[str], task: MultiViewTask, path: Path) -> Path:
    """Bars of the mean accuracy per condition (groups) and scheme (one colour each), std over seeds as error bars,
    chance as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(schemes)
    colours = plt.get_cmap("tab10")
    for i, scheme in enumerate(schemes):
        runs = [r for r in records if r["scheme"] == scheme]
        values = [[r["accuracy"][c] for r in runs] for c in CONDITIONS]
        means = [statistics.mean(v) for v in values]
        stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        xs = [j + (i - (len(schemes) - 1) / 2) * width for j in range(len(CONDITIONS))]
        ax.bar(xs, means, width, yerr=stds, capsize=3, color=colours(i % 10), label=f"{scheme} ({kind(scheme)})")
    ax.axhline(task.chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({task.chance:.1f} %)")
    ax.set_xticks(range(len(CONDITIONS)), ["held-out scenes", "same scenes, world moved"])
    ax.set_ylabel("accuracy (%, mean ± std over seeds)")
    ax.set_ylim(0, 100)
    ax.set_title(QUESTIONS[task.label], fontsize=11)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_files(
    records: list[dict], schemes: list[str], task: MultiViewTask, args, out_dir: Path, command
) -> dict[str, Path]:
    """``out_dir/multiview.md`` (header, settings, summary table), ``.csv`` (a row per scheme, seed and condition)
    and ``.png``, through the benchmarks' writer (``bench/results.py``)."""
    markdown_table, table_cells, write_results = (
        getattr(bench_results(), name) for name in ("markdown_table", "table_cells", "write_results")
    )

    seeds = sorted({r["seed"] for r in records})
    notes = [
        f"Accuracy (%) on {args.eval_samples} held-out scenes, mean ± std over seeds {', '.join(map(str, seeds))}; "
        f"chance {task.chance:.1f} %. Each model: {args.steps} steps of {args.batch_size} fresh scenes, AdamW "
        f"(lr {args.lr:g}, warm-up and cosine), width {MODEL['embed_dim']}, depth {MODEL['depth']}, "
        f"{MODEL['num_heads']} heads, {MODEL['img_size']} px views in {MODEL['patch_size']} px patches, "
        f"`{POS_EMBED}` within views. Moved world: every camera moved by one random rigid motion per scene "
        f"(`cameras.transform(T)`, uniform rotation, translation std {MOVE_TRANSLATION:g}), never seen in training.",
    ]
    md, csv_path = write_results(
        NAME,
        seed_rows(records),
        SEED_COLUMNS,
        out_dir=out_dir,
        command=command,
        notes=notes,
        device="cpu",
        formats={"accuracy (%)": ".2f", "same prediction (%)": ".2f", "train seconds": ".0f"},
        # the commits the runs were trained at (reused runs may predate the current one)
        commit=", ".join(sorted({r.get("commit", "unknown") for r in records})),
    )
    # the Markdown file shows the summary over seeds (the CSV keeps every run); same first line and notes
    first = md.read_text().splitlines()[0]
    table = markdown_table(SUMMARY_COLUMNS, table_cells(summary_rows(records, schemes), SUMMARY_COLUMNS))
    md.write_text("\n\n".join([first, *notes, table]) + "\n")
    png = plot(records, schemes, task, out_dir / f"{NAME}.png")
    return {"md": md, "csv": csv_path, "png": png}


def main(argv: list[str] | None = None) -> dict[str, Path]:
    args = parse_args(argv)
    if args.quick:
        bench_results().print_quick_notice("--quick")
    schemes = check_args(args)
    torch.set_num_threads(args.threads)
    task = MultiViewTask(label=args.label)
    # every model is built once before training: options a scheme refuses fail here, not after hours
    for scheme in schemes:
        build_model(scheme, task)
    runs = [(scheme, seed) for scheme in schemes for seed in args.seeds]
    if args.jobs == 1 or len(runs) == 1:
        records = [run_one(scheme, seed, args) for scheme, seed in runs]
    else:  # independent runs in worker processes (forked: they share this module), args.threads threads each
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            records = list(pool.map(run_one, *zip(*runs, strict=True), [args] * len(runs)))
    command = sys.argv if argv is None else [__file__, *argv]
    paths = write_files(records, schemes, task, args, Path(args.out), command)
    print("\n" + paths["md"].read_text())
    if args.results is not None:
        results = write_files(records, schemes, task, args, Path(args.results), command)
        paths.update({f"results_{key}": path for key, path in results.items()})
    for label, path in paths.items():
        print(f"{label + ':':<12} {path}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
