"""Training steps per second of the full Lightning loop reading JPEG files through the GPU data pipeline, against the
same model on synthetic in-memory data (the ceiling a data pipeline can reach), in one run.

Rows (``--pipelines``, in this order): ``synthetic`` (one batch held on the device, cloned each step: no reading,
decoding, augmentation or transfer), ``gpu`` (``ImageFolderDataModule(gpu_pipeline=True)``: workers read the files,
nvJPEG decodes them on the GPU when ``--device cuda``, kornia augments the batch on the device), ``gpu-workers``
(the same with ``decode_on_device=False``: the workers decode and crop) and ``cpu`` (timm's transforms in the
workers, the default pipeline). Every row trains the same :class:`~visionpe.training.Classifier`
(DeiT recipe: mixup, cutmix, label smoothing, AdamW) with the same Trainer settings; steps/s is counted over
``--steps`` steps after ``--warmup`` steps, with the device synchronised at each step's end. The target on an H200
is ``gpu`` >= 0.90x ``synthetic``.

Without ``--data-root`` the script writes ``--num-images`` JPEGs of ImageNet-like sizes (about 500x375, smooth
content with detail, quality 90) to ``--cache`` once, and links them into an ImageNet-layout folder large enough that
the measured steps fit in one epoch (epoch boundaries would add worker restarts to the timing).

    python bench/data_pipeline.py --device cuda                                    # ViT-S/16, batch 256, 224 px
    python bench/data_pipeline.py --device cuda --data-root /path/to/imagenet
    python bench/data_pipeline.py --device cpu --dry-run                           # a tiny smoke run on the CPU

The table printed is also written to ``<--out>/data_pipeline.md`` and ``data_pipeline.csv`` (default
``runs/bench/data_pipeline``; ``bench/results.py``) and copied to ``--results DIR`` when given. ``--dry-run`` checks
the pipeline and measures nothing: it says so in one line and takes no ``--results``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results import add_output_arguments, copy_results, output_error, print_quick_notice, write_results  # noqa: E402
from visionpe.training import Classifier, ImageFolderDataModule  # noqa: E402

PIPELINES = ("synthetic", "gpu", "gpu-workers", "cpu")
NUM_CLASSES = 10
TINY_MODEL = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--data-root", help="an ImageNet-layout folder (train/<class>/*.JPEG, val/...)")
    parser.add_argument("--cache", default="runs/bench_data/jpegs", help="where the generated JPEGs are kept")
    parser.add_argument("--num-images", type=int, default=1024, help="distinct generated JPEGs")
    parser.add_argument("--model", default="visionpe_vit_small_patch16_224")
    parser.add_argument("--pos-embed", default="learned")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100, help="timed steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (workers, cuDNN, allocator)")
    parser.add_argument("--num-workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--precision", default=None, help="Trainer precision (bf16-mixed on cuda, 32-true on cpu)")
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    parser.add_argument("--dry-run", action="store_true", help="tiny model, 32 px, batch 4, 2 steps, 16 images")
    add_output_arguments(parser, "data_pipeline", "data_pipeline.md and .csv")
    args = parser.parse_args(argv)
    error = output_error(args.out, args.results, "--dry-run" if args.dry_run else None)
    if error:
        parser.error(error)
    if args.dry_run:
        args.img_size, args.batch_size, args.steps, args.warmup = 32, 4, 2, 1
        args.num_images, args.num_workers = min(args.num_images, 16), 0
    for name in ("num_images", "img_size", "batch_size", "steps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_workers < 0:
        parser.error(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu)")
    args.precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "32-true")
    return args


def write_jpegs(folder: Path, count: int, small: bool) -> list[Path]:
    """``count`` JPEGs of ImageNet-like sizes (or 40-64 px when ``small``), written once and reused."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    paths = []
    for i in range(count):
        path = folder / f"{i:05d}.jpg"
        paths.append(path)
        if path.exists():
            continue
        base = 48 if small else 375
        height = base + int(torch.randint(0, base // 3, (), generator=generator))
        width = int(height * (4 / 3 if i % 3 else 3 / 4))
        coarse = torch.rand(1, 3, 12, 16, generator=generator)
        image = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)[0]
        image = image + 0.08 * torch.randn(3, height, width, generator=generator)  # detail: realistic file sizes
        pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(path, quality=90)
    return paths


def link_folder(root: Path, images: list[Path], train_images: int) -> Path:
    """An ImageNet-layout folder of hard links (copies where links fail) to ``images``, ``train_images`` in train/."""
    for split, count in (("train", train_images), ("val", NUM_CLASSES)):
        for i in range(count):
            path = root / split / f"class{i % NUM_CLASSES:02d}" / f"{i:06d}.jpg"
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            source = images[i % len(images)]
            try:
                os.link(source, path)
            except OSError:
                path.write_bytes(source.read_bytes())
    return root


class SyntheticData(L.LightningDataModule):
    """One random batch held on the device, cloned for every step (``steps`` steps per epoch)."""

    def __init__(self, batch_size: int, img_size: int, steps: int, device: str) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch_size, 3, img_size, img_size, generator=generator).to(device)
        self.y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator).to(device)
        self.batch_size, self.steps = batch_size, steps  # batch_size: the module scales its learning rate by it

    def train_dataloader(self) -> _Repeat:
        return _Repeat(self.x, self.y, self.steps)


class _Repeat:
    """``steps`` fresh clones of one batch (mixup mixes in place), made as they are asked for."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
        self.x, self.y, self.steps = x, y, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return ((self.x.clone(), self.y.clone()) for _ in range(self.steps))


class StepTimer(L.Callback):
    """Time at the end of every training step, after synchronising the device."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available() and module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
        self.times.append(time.perf_counter())


def steps_per_second(args: argparse.Namespace, data: L.LightningDataModule) -> float:
    """Train ``warmup + steps`` steps; steps/s over the last ``steps``."""
    L.seed_everything(0, verbose=False)
    model_kwargs = TINY_MODEL if args.dry_run else {"img_size": args.img_size}
    model = Classifier(args.model, pos_embed=args.pos_embed, model_kwargs=model_kwargs, num_classes=NUM_CLASSES)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator=args.device,
        devices=1,
        precision=args.precision,
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, data)
    times = timer.times[args.warmup - 1 :]
    if len(times) != args.steps + 1:
        raise RuntimeError(f"expected {args.warmup + args.steps} timed steps, got {len(timer.times)}")
    return args.steps / (times[-1] - times[0])


def main(argv: list[str] | None = None) -> list[list]:
    args = parse_args(argv)
    if args.dry_run:
        print_quick_notice("--dry-run")
    torch.set_float32_matmul_precision("high")
    steps = args.warmup + args.steps
    if args.data_root is None:
        cache = Path(args.cache)
        images = write_jpegs(cache / ("small" if args.dry_run else "images"), args.num_images, small=args.dry_run)
        root = link_folder(cache / f"folder_{steps * args.batch_size}", images, (steps + 1) * args.batch_size)
        source = f"{args.num_images} generated JPEGs linked into {(steps + 1) * args.batch_size} training images"
    else:
        root, source = Path(args.data_root), "the JPEG folder given with --data-root"
    rows, baseline = [], None
    for pipeline in args.pipelines:
        if pipeline == "synthetic":
            data = SyntheticData(args.batch_size, args.img_size, steps, args.device)
        else:
            data = ImageFolderDataModule(
                root,
                img_size=args.img_size,
                batch_size=args.batch_size,
                num_workers=args.num_workers,
                gpu_pipeline=pipeline != "cpu",
                decode_on_device=pipeline == "gpu",
            )
        rate = steps_per_second(args, data)
        baseline = baseline or (rate if pipeline == "synthetic" else None)
        ratio = f"{rate / baseline:.3f}x" if baseline else "-"
        rows.append([pipeline, rate, rate * args.batch_size, ratio])
        print(f"{pipeline:10s} {rate:8.2f} steps/s {rate * args.batch_size:10.1f} images/s  {ratio}", flush=True)
    decode = "nvJPEG on the GPU (gpu-workers: the workers)" if args.device == "cuda" else "the workers (CPU)"
    notes = (
        f"{args.model} ({args.pos_embed}{', tiny dry-run width' if args.dry_run else ''}), {args.img_size} px, "
        f"batch {args.batch_size}, {args.precision}, {args.steps} steps timed after {args.warmup}, "
        f"{args.num_workers} workers; data: {source}; gpu pipeline decodes with {decode}"
    )
    columns = ["pipeline", "steps/s", "images/s", "ratio to synthetic"]
    paths = write_results(
        "data_pipeline",
        rows,
        columns,
        out_dir=args.out,
        notes=notes,
        device=args.device,
        formats={"steps/s": ".2f", "images/s": ".1f"},
    )
    if args.results is not None:
        copy_results(paths, args.results)
    return rows


if __name__ == "__main__":
    main()
