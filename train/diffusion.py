r"""Extrapolation modes of a tiny diffusion transformer, sampled beyond its training size: what breaks, what helps.

Two tiny diffusers transformers, trained by rectified flow on the CPU (``train/experiments/diffusion.py``):

- image: a ``FluxTransformer2DModel`` on the scenes of ``train/experiments/scenes.py`` at 32 px (4 x 4 pixel
  patches: an 8 x 8 token grid), sampled at 64 px (16 x 16 tokens) under every mode of ``--modes``; measured:
  the objects per image and their areas, read by a detector of the renderer's objects, against rendered scenes of
  the same pixels per object (a canvas of 2 x 2 training fields: the objects keep their pixel size);
- video: a ``WanTransformer3DModel`` on moving digits (``train/experiments/moving_digits.py``) of 8 frames, sampled
  at 16 frames under every mode of ``--video-modes`` on the time axis; measured: the similarity of frame f to
  frame f + 8 (a clip that repeats itself scores near 1), against real 16-frame clips.

The whole measurement (3 seeds, about 25 minutes of one CPU core; 31 minutes on a 2-core CPU with one core busy):

    python train/diffusion.py --threads 1 --results docs/benchmarks/results

A check of the whole pipeline in seconds (a few steps of a smaller model; it says in one line that its numbers
measure nothing, and its ``--results`` may be any folder but the published one):

    python train/diffusion.py --quick

Output under ``--out`` (default ``runs/diffusion``, ``runs/diffusion_quick``): ``results.csv`` (one row per part,
samples, mode and seed), ``results.md`` (the tables, mean ± std over seeds), ``samples.png`` (the first seed's
samples), per part and seed ``<part>/seed<k>/model.pt`` (the averaged weights; ``--reuse`` loads them instead of
training again). ``--results DIR`` also writes ``DIR/diffusion.md`` and ``.csv`` (objects per image),
``diffusion_size.md`` and ``.csv`` (object areas), ``diffusion_video.md`` and ``.csv`` (lag similarity) and
``diffusion.png``, headed by the date, commit, versions, device and command (``bench/results.py``). ``--jobs N``
runs N (part, seed) units at once, one process each.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the experiments package beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import visionpe
from experiments.diffusion import (
    DETECT_MIN_AREA,
    DETECT_THRESHOLD,
    data_statistics,
    detect_objects,
    digit_clips,
    lag_similarity,
    sample,
    scene_images,
    tiny_flux,
    tiny_wan,
    train_denoiser,
    validate_detector,
)
from experiments.sweep import bench_results, call_by_name, set_worker_threads
from visionpe.checks import check_int

PARTS = ("image", "video")
IMAGE_MODES = ("none", "pi", "ntk", "yarn", "riflex", "dype")
VIDEO_MODES = ("none", "pi", "ntk", "riflex")
SCALE = 2  # sampled at twice the training side (image) or length (video)
LAG = 8  # the video measure's lag: the training length
FIELDS = ["part", "samples", "mode", "seed", "size", "n", "objects", "area", "too_large", "lag1", "lag8"]

# the measurement; every entry can be overridden from the command line (see parse_args)
SETTINGS = {
    "image": {
        "img_size": 32,
        "patch": 4,
        "width": 64,
        "heads": 2,
        "depth": 2,
        "steps": 2000,
        "batch_size": 32,
        "lr": 1e-3,
        "samples": 64,
        "sample_steps": 25,
    },
    "video": {
        "img_size": 16,
        "digit_size": 8,
        "frames": 8,
        "patch": 4,
        "width": 48,
        "heads": 2,
        "depth": 2,
        "steps": 1000,
        "batch_size": 32,
        "lr": 1e-3,
        "samples": 32,
        "sample_steps": 25,
    },
    "detector_images": 2000,
}
# --quick: a check of the pipeline, not a measurement (a few steps of a smaller model)
QUICK = {
    "image": {"width": 32, "depth": 1, "steps": 3, "batch_size": 4, "samples": 4, "sample_steps": 2},
    "video": {"width": 24, "depth": 1, "steps": 3, "batch_size": 4, "samples": 2, "sample_steps": 2},
    "detector_images": 50,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), help=f"what to run (default: all of {PARTS})")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default 0 1 2)")
    parser.add_argument("--modes", nargs="+", default=None, help=f"image modes (default: {' '.join(IMAGE_MODES)})")
    parser.add_argument(
        "--video-modes",
        nargs="+",
        default=None,
        help=f"video modes on the time axis (default: {' '.join(VIDEO_MODES)})",
    )
    parser.add_argument("--steps", type=int, default=None, help="image training steps (default 2000)")
    parser.add_argument("--video-steps", type=int, default=None, help="video training steps (default 1000)")
    parser.add_argument("--samples", type=int, default=None, help="images per mode and seed (default 64)")
    parser.add_argument("--video-samples", type=int, default=None, help="clips per mode and seed (default 32)")
    parser.add_argument("--out", default=None, help="output folder (default runs/diffusion, runs/diffusion_quick)")
    parser.add_argument("--reuse", action="store_true", help="load the trained weights found under --out")
    parser.add_argument("--quick", action="store_true", help="a check of the pipeline: a few steps, a smaller model")
    parser.add_argument("--results", default=None, help="also write <results>/diffusion*.md, .csv and .png")
    parser.add_argument("--jobs", type=int, default=1, help="(part, seed) units run at once, one process each")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per unit (default: cores / jobs)")
    args = parser.parse_args(argv)
    error = bench_results().output_error(args.out, args.results, "--quick" if args.quick else None, quick_results=True)
    if error:
        parser.error(error)
    return args


def settings_from(args: argparse.Namespace) -> dict:
    """The run's settings: :data:`SETTINGS`, with :data:`QUICK` on top under ``--quick``, then the explicit
    arguments; every value checked (a ValueError names the argument)."""
    settings = {part: dict(SETTINGS[part]) for part in PARTS}
    settings["detector_images"] = SETTINGS["detector_images"]
    if args.quick:
        for part in PARTS:
            settings[part].update(QUICK[part])
        settings["detector_images"] = QUICK["detector_images"]
    for name, part, key in (
        ("steps", "image", "steps"),
        ("video_steps", "video", "steps"),
        ("samples", "image", "samples"),
        ("video_samples", "video", "samples"),
    ):
        value = getattr(args, name)
        if value is not None:
            settings[part][key] = check_int(value, f"--{name.replace('_', '-')}", min=1)
    parts = list(args.parts)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts or len(set(parts)) != len(parts):
        raise ValueError(f"--parts must name distinct parts among {PARTS}, got {parts}")
    seeds = [0, 1, 2] if args.seeds is None else list(args.seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ValueError(f"--seeds must be distinct ints >= 0, got {seeds}")
    if args.quick and args.seeds is None:
        seeds = [0]
    modes = list(IMAGE_MODES if args.modes is None else args.modes)
    video_modes = list(VIDEO_MODES if args.video_modes is None else args.video_modes)
    for name, values in (("--modes", modes), ("--video-modes", video_modes)):
        bad = [m for m in values if m not in IMAGE_MODES]
        if bad or not values or len(set(values)) != len(values):
            raise ValueError(f"{name} must be distinct modes among {IMAGE_MODES}, got {values}")
    settings.update(
        parts=parts,
        seeds=seeds,
        modes=modes,
        video_modes=video_modes,
        out=Path(args.out or ("runs/diffusion_quick" if args.quick else "runs/diffusion")),
        reuse=args.reuse,
    )
    return settings


# --- one (part, seed) ---------------------------------------------------------------------------------------------


def _generator(seed: int, stream: int) -> torch.Generator:
    # one stream per use (training, real data, sampling), drawn from the seed alone
    return torch.Generator().manual_seed(seed * 1000 + stream)


def _train_or_load(model, path: Path, reuse: bool, train, grid) -> tuple[torch.nn.Module, str]:
    """The averaged weights of ``model`` trained by ``train`` (or loaded from ``path`` under ``reuse``), with
    visionpe's rotary in place (``apply_position_scheme``, training grid ``grid``: the model's own encoding until a
    mode is set), and a progress line."""
    from visionpe.integrations.diffusers import apply_position_scheme

    if reuse and path.is_file():
        model.load_state_dict(torch.load(path, weights_only=True))
        average, line = model.eval(), "loaded"
    else:
        started = time.perf_counter()
        average, losses = train(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(average.state_dict(), path)
        tail = losses[-min(100, len(losses)) :]
        line = f"trained in {time.perf_counter() - started:.0f} s, final loss {statistics.fmean(tail):.4f}"
    apply_position_scheme(average, train_grid_size=grid)
    return average, line


def _image_row(samples: str, mode: str, seed: int, images: torch.Tensor, largest: int) -> dict:
    found = detect_objects(images)
    areas = torch.cat(found).float()
    return {
        "part": "image",
        "samples": samples,
        "mode": mode,
        "seed": seed,
        "size": images.shape[-1],
        "n": len(images),
        "objects": statistics.fmean(len(a) for a in found),
        "area": float(areas.mean()) if len(areas) else float("nan"),
        "too_large": 100 * float((areas > largest).float().mean()) if len(areas) else float("nan"),
    }


def training_area_range(images: int = 2000) -> tuple[int, int]:
    """The smallest and largest object area (px) the detector finds on ``images`` rendered training scenes (a
    fixed set): the range of object sizes the model was trained on."""
    real, _ = scene_images(images, torch.Generator().manual_seed(12345))
    areas = torch.cat(detect_objects(real))
    return int(areas.min()), int(areas.max())


def run_image(seed: int, settings: dict) -> tuple[list[dict], dict, str]:
    """Train the image model of ``seed`` (or load it), sample at the training size and at :data:`SCALE` times the
    side under every mode; rows for the samples and the real scenes, previews of the first samples."""
    s = settings["image"]
    size, patch = s["img_size"], s["patch"]
    grid = size // patch
    torch.manual_seed(seed)
    model = tiny_flux(patch, s["width"], s["heads"], s["depth"], s["depth"])

    data = lambda n, g: scene_images(n, g, px_per_unit=size)[0]  # noqa: E731
    mean, std = data_statistics(data)

    def train(m):
        return train_denoiser(
            m, data, s["steps"], s["batch_size"], _generator(seed, 1), mean, std, patch=patch, lr=s["lr"], warmup=100
        )

    model, line = _train_or_load(
        model, settings["out"] / "image" / f"seed{seed}" / "model.pt", settings["reuse"], train, (1, grid, grid)
    )
    _, largest = settings["area_range"]
    n = s["samples"]
    rows, previews = [], {}
    real, _ = scene_images(n, _generator(seed, 2), px_per_unit=size)
    rows.append(_image_row("training scenes", "", seed, real, largest))
    canvas, _ = scene_images(n, _generator(seed, 3), field=float(SCALE), px_per_unit=size)
    rows.append(_image_row("canvas reference", "", seed, canvas, largest))
    previews["canvas reference"] = canvas[:6]
    started = time.perf_counter()
    x = sample(model, (n, 3, size, size), s["sample_steps"], _generator(seed, 4), mean, std, patch)
    rows.append(_image_row("samples", "none", seed, x, largest))
    previews["samples 1x"] = x[:6]
    for mode in settings["modes"]:
        visionpe.set_extrapolation(model, mode)
        x = sample(model, (n, 3, SCALE * size, SCALE * size), s["sample_steps"], _generator(seed, 5), mean, std, patch)
        rows.append(_image_row("samples", mode, seed, x, largest))
        previews[mode] = x[:6]
    visionpe.set_extrapolation(model, "none")
    line += f"; sampled {n} images x {1 + len(settings['modes'])} in {time.perf_counter() - started:.0f} s"
    return rows, previews, line


def _video_row(samples: str, mode: str, seed: int, clips: torch.Tensor) -> dict:
    frames = clips.shape[2]
    return {
        "part": "video",
        "samples": samples,
        "mode": mode,
        "seed": seed,
        "size": frames,
        "n": len(clips),
        "lag1": float(lag_similarity(clips, 1).mean()),
        "lag8": float(lag_similarity(clips, LAG).mean()) if frames > LAG else None,
    }


def run_video(seed: int, settings: dict) -> tuple[list[dict], dict, str]:
    """Train the video model of ``seed`` (or load it), sample clips of the training length and of :data:`SCALE`
    times it under every video mode (time axis only); rows for the samples and the real clips."""
    from experiments.moving_digits import MovingDigitsDataModule

    s = settings["video"]
    size, patch, frames = s["img_size"], s["patch"], s["frames"]
    datamodule = MovingDigitsDataModule(
        num_frames=frames,
        eval_frames=(SCALE * frames,),
        img_size=size,
        digit_size=s["digit_size"],
        speeds=(1,),
        seed=seed,
    )
    torch.manual_seed(seed)
    model = tiny_wan(patch, s["width"], s["heads"], s["depth"])

    data = lambda n, g: digit_clips(datamodule, n, frames, g)  # noqa: E731
    mean, std = data_statistics(data)

    def train(m):
        return train_denoiser(m, data, s["steps"], s["batch_size"], _generator(seed, 11), mean, std, lr=s["lr"])

    model, line = _train_or_load(
        model,
        settings["out"] / "video" / f"seed{seed}" / "model.pt",
        settings["reuse"],
        train,
        (frames, size // patch, size // patch),
    )
    n = s["samples"]
    rows, previews = [], {}
    real = digit_clips(datamodule, n, SCALE * frames, _generator(seed, 12), evaluation=True)
    rows.append(_video_row("real clips", "", seed, real[:, :, :frames]))
    rows.append(_video_row("real clips", "", seed, real))
    previews["real clips"] = real[:2]
    started = time.perf_counter()
    x = sample(model, (n, 1, frames, size, size), s["sample_steps"], _generator(seed, 13), mean, std)
    rows.append(_video_row("samples", "none", seed, x))
    for mode in settings["video_modes"]:
        visionpe.set_extrapolation(model, mode, axes=None if mode == "none" else ("time",))
        x = sample(model, (n, 1, SCALE * frames, size, size), s["sample_steps"], _generator(seed, 14), mean, std)
        rows.append(_video_row("samples", mode, seed, x))
        previews[mode] = x[:2]
    visionpe.set_extrapolation(model, "none")
    line += f"; sampled {n} clips x {1 + len(settings['video_modes'])} in {time.perf_counter() - started:.0f} s"
    return rows, previews, line


def run_unit(part: str, seed: int, settings: dict) -> tuple[list[dict], dict, str]:
    """One (part, seed): its rows, previews and progress line (with its CPU time)."""
    started = time.process_time()
    rows, previews, line = (run_image if part == "image" else run_video)(seed, settings)
    return rows, previews, f"{line}; {time.process_time() - started:.0f} s of CPU"


# --- tables ---------------------------------------------------------------------------------------------------------


def _fmt(values: list[float], digits: int) -> str:
    values = [v for v in values if v is not None and v == v]
    if not values:
        return ""
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _label(row: dict) -> str:
    return row["samples"] if not row["mode"] else f"{row['samples']}, {row['mode']}"


def table(rows: list[dict], part: str, metrics: list[tuple[str, str, int]]) -> tuple[list[str], list[list[str]]]:
    """(columns, cells) of one measurement: one row per (samples, mode, size) of ``part`` in order of appearance,
    each metric as mean ± std over seeds."""
    keys = []
    for row in rows:
        key = (row["samples"], row["mode"], int(row["size"]))
        if row["part"] == part and key not in keys:
            keys.append(key)
    columns = ["samples", "size", *(title for _, title, _ in metrics)]
    cells = []
    for samples, mode, size in keys:
        group = [
            r for r in rows if r["part"] == part and (r["samples"], r["mode"], int(r["size"])) == (samples, mode, size)
        ]
        size_text = f"{size} px" if part == "image" else f"{size} frames"
        cells.append(
            [
                _label(group[0]),
                size_text,
                *(_fmt([_float(r[key]) for r in group], digits) for key, _, digits in metrics),
            ]
        )
    return columns, cells


def _float(value) -> float | None:
    if value is None or value == "":
        return None
    return float(value)


TABLES = {
    "diffusion": ("image", [("objects", "objects per image", 2)]),
    "diffusion_size": (
        "image",
        [("area", "mean object area (px)", 1), ("too_large", "larger than any training object (%)", 1)],
    ),
    "diffusion_video": ("video", [("lag1", "lag-1 similarity", 3), ("lag8", "lag-8 similarity", 3)]),
}


def notes(name: str, rows: list[dict], settings: dict, detector: dict | None) -> list[str]:
    seeds = sorted({int(r["seed"]) for r in rows})
    over = f"mean ± std over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    s, v = settings["image"], settings["video"]
    if name.startswith("diffusion") and name != "diffusion_video":
        lines = [
            f"Tiny Flux (width {s['width']}, {s['heads']} heads, {s['depth']} + {s['depth']} blocks, {s['patch']} x "
            f"{s['patch']} px patches) trained {s['steps']} steps of {s['batch_size']} scenes at {s['img_size']} px "
            f"(rectified flow), {s['samples']} samples per row and seed ({s['sample_steps']} Euler steps); {over}. "
            f"Rows: rendered scenes (training size; a canvas of {SCALE} x {SCALE} training fields at the training "
            f"pixels per unit: what a {SCALE}x-side image with objects of the training size holds), the samples at "
            f"the training size, and the samples at {SCALE}x the side under each extrapolation mode.",
            f"Objects: 4-connected components of pixels brighter than {DETECT_THRESHOLD} (any channel), at least "
            f"{DETECT_MIN_AREA} px.",
        ]
        if detector:
            lines.append(
                "Detector on rendered scenes: exact count on "
                + "; ".join(
                    f"{100 * d['exact']:.2f} % of {d['images']} scenes of {d['cells']:g} x {d['cells']:g} cells "
                    f"(area vs the shape's analytic area: correlation {d['area_corr']:.2f})"
                    for d in detector
                )
                + "."
            )
        if name == "diffusion_size":
            lo, hi = settings["area_range"]
            lines.append(
                f"Training objects' areas range over {lo}-{hi} px ({settings['detector_images']} rendered scenes)."
            )
        return lines
    return [
        f"Tiny Wan (width {v['width']}, {v['heads']} heads, {v['depth']} blocks, 1 x {v['patch']} x {v['patch']} px "
        f"patches) trained {v['steps']} steps of {v['batch_size']} moving-digit clips of {v['frames']} frames at "
        f"{v['img_size']} px (one digit of {v['digit_size']} px, 1 px per frame on a wrapping canvas), "
        f"{v['samples']} clips per row and seed ({v['sample_steps']} Euler steps); {over}. Modes on the time axis "
        f"only. Lag-k similarity: cosine similarity of frame f and frame f + k, each centred, averaged over f and "
        f"clips; a clip that repeats itself after {LAG} frames has a lag-{LAG} similarity near 1."
    ]


def markdown(rows: list[dict], settings: dict, detector) -> str:
    lines = ["# Diffusion transformers beyond their training size (tiny models, CPU)"]
    titles = {"diffusion": "Objects per image", "diffusion_size": "Object size", "diffusion_video": "Repeated content"}
    for name, (part, metrics) in TABLES.items():
        if not any(r["part"] == part for r in rows):
            continue
        columns, cells = table(rows, part, metrics)
        lines += ["", f"## {titles[name]}", ""]
        lines += [*(n + "\n" for n in notes(name, rows, settings, detector))]
        lines.append(bench_results().markdown_table(columns, cells))
    return "\n".join(lines) + "\n"


def plot(previews: dict, path: Path) -> None:
    """The first seed's samples: one row per set (images), one strip of frames per set (video)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [(part, name, x) for part in PARTS for name, x in previews.get(part, {}).items()]
    if not sets:
        return
    fig, axes = plt.subplots(len(sets), 1, figsize=(12, 1.6 * len(sets)), squeeze=False)
    for ax, (part, name, x) in zip(axes[:, 0], sets, strict=True):
        if part == "image":
            strip = torch.cat([torch.nn.functional.pad(im, (1, 1, 1, 1), value=0.5) for im in x], dim=2)
        else:
            clip = x[0, 0]  # (T, H, W) of the first clip
            strip = torch.cat([torch.nn.functional.pad(f, (1, 1, 1, 1), value=0.5) for f in clip], dim=1)[None]
            strip = strip.expand(3, -1, -1)
        ax.imshow(strip.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_ylabel(f"{part}\n{name}", rotation=0, ha="right", va="center", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: row.get(k) for k in FIELDS} for row in rows)


def write_published(rows, settings, detector, previews_png: Path, out_dir: str, command) -> list[Path]:
    """``diffusion*.md`` and ``.csv`` through the benchmarks' shared writer, one per measurement, and the samples
    plot as ``diffusion.png``."""
    results = bench_results()
    written = []
    for name, (part, metrics) in TABLES.items():
        if not any(r["part"] == part for r in rows):
            continue
        columns, cells = table(rows, part, metrics)
        written += results.write_results(
            name,
            cells,
            columns,
            out_dir=out_dir,
            command=results.last_options(command),
            notes=notes(name, rows, settings, detector),
            device="cpu",
        )
    if previews_png.is_file():
        written += results.copy_results([previews_png], out_dir)
        target = Path(out_dir) / "diffusion.png"
        (Path(out_dir) / previews_png.name).replace(target)
        written[-1] = target
    return written


def main(argv: list[str] | None = None) -> dict[str, Path]:
    args = parse_args(argv)
    if args.quick:
        bench_results().print_quick_notice("--quick")
    settings = settings_from(args)
    check_int(args.jobs, "jobs", min=1)
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.threads is None else args.threads
    check_int(threads, "threads", min=1)
    out = settings["out"]
    started = time.perf_counter()
    detector = None
    if "image" in settings["parts"]:
        settings["area_range"] = training_area_range(settings["detector_images"])
        n = settings["detector_images"]
        detector = [validate_detector(n, torch.Generator().manual_seed(7 + f), field=float(f)) for f in (1, SCALE)]
    units = [(part, seed) for part in settings["parts"] for seed in settings["seeds"]]
    print(
        f"Training and sampling {len(units)} unit(s) ({', '.join(settings['parts'])} x seeds "
        f"{' '.join(map(str, settings['seeds']))}); output in {out}" + (f"; {args.jobs} jobs" if args.jobs > 1 else ""),
        flush=True,
    )
    found: dict[int, tuple[list[dict], dict]] = {}

    def report(index: int, rows: list[dict], previews: dict, line: str) -> None:
        found[index] = (rows, previews)
        part, seed = units[index]
        print(f"[{len(found)}/{len(units)}] {part}, seed {seed}: {line}", flush=True)

    if args.jobs == 1:
        torch.set_num_threads(threads)
        for index, (part, seed) in enumerate(units):
            report(index, *run_unit(part, seed, settings))
    else:
        context = multiprocessing.get_context("spawn")
        one = (run_unit.__module__, run_unit.__name__)
        with ProcessPoolExecutor(
            args.jobs, mp_context=context, initializer=set_worker_threads, initargs=(threads,)
        ) as pool:
            futures = {pool.submit(call_by_name, *one, part, seed, settings): i for i, (part, seed) in enumerate(units)}
            for future in as_completed(futures):
                report(futures[future], *future.result())
    rows = [row for index in range(len(units)) for row in found[index][0]]
    first = {}
    for index, (part, seed) in enumerate(units):
        if seed == settings["seeds"][0]:
            first[part] = found[index][1]
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "results.md", "csv": out / "results.csv", "png": out / "samples.png"}
    _write_rows(paths["csv"], rows)
    paths["md"].write_text(markdown(rows, settings, detector))
    plot(first, paths["png"])
    print("\n" + paths["md"].read_text())
    print(f"wall time {time.perf_counter() - started:.0f} s")
    if args.results is not None:
        command = sys.argv if argv is None else [__file__, *argv]
        for path in write_published(rows, settings, detector, paths["png"], args.results, command):
            paths[f"results_{path.stem}_{path.suffix[1:]}"] = path
            print(f"results: {path}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
