"""GPU smoke benchmark: the ImageNet pipeline (timm transforms, DeiT recipe, bf16-mixed) on a generated
ImageFolder, 60 steps per scheme (the step rate: median of steps 21-60), images/s per scheme and the ratio to
timm's vit_small_patch16_224.

Two rates are printed: ``step img/s`` times only the training step (forward, backward, optimizer; CUDA
synchronised), which is what the position encoding changes; ``wall img/s`` includes data loading, which a
generated JPEG folder and a few CPU workers can bottleneck. Run through ``bash bench/gpu_smoke.sh``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from PIL import Image

import visionpe
from visionpe.training import Classifier, ImageFolderDataModule


def make_image_folder(root: Path, classes: int = 10, per_class: int = 64, size: int = 256) -> Path:
    """A small ImageNet-layout folder of random JPEGs (train/ and val/), made once."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", max(per_class // 8, 2))):
        for c in range(classes):
            folder = root / split / f"class{c:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                path = folder / f"{i:05d}.jpg"
                if not path.exists():
                    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path, quality=90)
    return root


class StepTimer(Callback):
    """Times training steps after ``warmup`` steps, synchronising CUDA around each."""

    def __init__(self, warmup: int = 20) -> None:
        self.warmup, self.times, self._start = warmup, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def run(model_name: str, pos_embed, data: ImageFolderDataModule, steps: int, precision: str) -> tuple[float, float]:
    module = Classifier(model_name=model_name, pos_embed=pos_embed, num_classes=data.num_classes)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - start
    step = statistics.median(timer.times)
    return data.batch_size / step, data.batch_size * steps / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default="runs/gpu_smoke_data")
    parser.add_argument("--steps", type=int, default=60)  # 200 ran past the 8 minutes on an H200
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--schemes", nargs="*", default=None)
    args = parser.parse_args()
    data = ImageFolderDataModule(
        make_image_folder(Path(args.root)), img_size=224, batch_size=args.batch, num_workers=args.workers
    )
    data.setup("fit")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no GPU found)"
    print(f"{time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}, batch {args.batch}, {args.precision}")
    rows = [("timm vit_small_patch16_224 (baseline)", "vit_small_patch16_224", None)]
    rows += [(s, "visionpe_vit_small_patch16_224", s) for s in (args.schemes or visionpe.list_schemes())]
    base = None
    print("| model | step img/s | ratio | wall img/s |\n|---|---|---|---|")
    for label, model_name, scheme in rows:
        step_rate, wall_rate = run(model_name, scheme, data, args.steps, args.precision)
        base = base or step_rate
        print(f"| {label} | {step_rate:.0f} | {step_rate / base:.3f}x | {wall_rate:.0f} |", flush=True)


if __name__ == "__main__":
    main()
