"""ImageNet-layout image folders (``root/train/<class>/*.JPEG``, ``root/val/<class>/*.JPEG``) with timm's transforms.

Training uses timm's ``create_transform(is_training=True)``: RandomResizedCrop (scale 0.08-1), horizontal flip,
RandAugment (``auto_augment``) and random erasing (``re_prob``), the DeiT recipe; mixup/cutmix act on batches and
belong to the LightningModule (``timm.data.Mixup``). Evaluation uses timm's eval transform: resize to
``img_size / crop_pct``, centre crop ``img_size`` (``crop_pct=1.0``: resize to N, centre crop N), also at every
other size asked of :meth:`ImageFolderDataModule.eval_dataloader`. Normalisation is ImageNet's
(:data:`IMAGENET_MEAN`, :data:`IMAGENET_STD`).

**GPU pipeline** (``gpu_pipeline=True``): the DataLoader workers only decode and crop, and the augmentation runs
batched on the batch's device in :meth:`ImageFolderDataModule.on_after_batch_transfer`
(:class:`~visionpe.training.gpu_augment.BatchAugment`, built on kornia). Each worker reads the image size from the
file header, draws the sample's parameters (timm's RandomResizedCrop box from the image's own size, flip,
RandAugment ops and magnitudes, erasing box) from the sample's seed, decodes the file to uint8 and resizes the crop
box to ``img_size`` (bicubic/bilinear with antialiasing): so the crop statistics are timm's exactly (the box is
drawn in the original image's pixels, not in a resized copy), and batches are (B, 3, S, S) uint8, a quarter of the
float32 bytes. When the trainer runs on CUDA and ``decode_on_device`` is true, the workers send the file bytes and
the box instead, and :meth:`~ImageFolderDataModule.on_before_batch_transfer` decodes the batch with nvJPEG
(``torchvision.io.decode_jpeg(device="cuda")``) and crops it there. Evaluation keeps timm's CPU eval transform.

Determinism: training batches are a pure function of ``(seed, epoch)``, as for
:class:`~visionpe.training.FrameClipDataModule`. The training sampler
(:class:`~visionpe.training.sampling.EpochSampler`) shuffles with a generator seeded by ``(seed, epoch)`` and hands
each sample its epoch; each sample's augmentation runs with Python's ``random``, NumPy's and torch's global RNGs
seeded from ``(seed, epoch, index)`` (timm's transforms draw from all three) and restored afterwards. So a run
resumed from a checkpoint sees the batches of the uninterrupted run, whatever the global RNG states,
``num_workers`` or the number of DDP processes. The GPU pipeline draws every random parameter the same way (on the
worker, from the sample's seed; the device only applies them), so it keeps this property; its images differ from
the CPU pipeline's (other resampling and draws), and across devices only by floating-point rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from .gpu_augment import BatchAugment, _augment_batch, _collate_samples, _GPUPipelineHooks, _WorkerSamples
from .sampling import (
    _TRAIN_STREAM,
    EpochSampler,
    _check_int,
    _check_int_tuple,
    _collate,
    _one_thread,
    _sample_seed,
    _seeded_rngs,
    _unpack,
)

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "ImageFolderDataModule", "scan_image_folder"]

IMAGENET_MEAN = tuple(IMAGENET_DEFAULT_MEAN)
IMAGENET_STD = tuple(IMAGENET_DEFAULT_STD)
_INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "random")


def scan_image_folder(split_dir: str | Path) -> ImageFolder:
    """One split of an ImageNet-layout folder as a torchvision ``ImageFolder`` without transform.

    Args:
        split_dir: a folder with one subfolder per class, each holding image files (searched recursively).

    Returns:
        the ``ImageFolder``; its items are ``(PIL image, class index)``, classes sorted by folder name.

    Raises:
        ValueError: naming the path, when ``split_dir`` is missing, has no class folders, or has class folders
            without images (all such folders are listed).
    """
    if not isinstance(split_dir, (str, Path)):
        raise TypeError(f"split_dir must be a str or Path, got {type(split_dir).__name__}")
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise ValueError(
            f"image folder {split_dir} does not exist or is not a folder; expected <root>/<split>/<class>/"
        )
    class_dirs = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise ValueError(f"image folder {split_dir} has no class folders; expected {split_dir}/<class>/<image files>")
    dataset = ImageFolder(str(split_dir), allow_empty=True)
    counts = torch.bincount(torch.tensor(dataset.targets, dtype=torch.long), minlength=len(dataset.classes))
    empty = [str(split_dir / name) for name, count in zip(dataset.classes, counts.tolist(), strict=True) if count == 0]
    if empty:
        raise ValueError(
            f"image folder {split_dir}: {len(empty)} class folder(s) without images ({', '.join(empty)}); "
            f"expected files with an extension in {IMG_EXTENSIONS}"
        )
    return dataset


class _Transformed(Dataset):
    """``(transform(image), label)`` for the items of an untransformed dataset.

    With a ``seed`` (training), items are ``index`` or ``(index, epoch)`` and the transform runs with the global RNGs
    seeded from ``(seed, epoch, index)`` (see :func:`~visionpe.training.sampling._seeded_rngs`); without one
    (evaluation, deterministic transforms) it runs as it is.
    """

    def __init__(self, dataset: Dataset, transform: Callable[[Any], torch.Tensor], seed: int | None = None) -> None:
        self.dataset, self.transform, self.seed = dataset, transform, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, epoch = _unpack(item)
        image, label = self.dataset[index]
        with _one_thread():
            if self.seed is None:
                return self.transform(image), label
            with _seeded_rngs(_sample_seed(self.seed, _TRAIN_STREAM, epoch, index)):
                return self.transform(image), label


class _ImageFiles:
    """``index -> ([path], label)`` of an ImageFolder's samples (picklable for DataLoader workers)."""

    def __init__(self, samples: list[tuple[str, int]]) -> None:
        self.samples = samples

    def __call__(self, index: int) -> tuple[list[Path], int]:
        path, label = self.samples[index]
        return [Path(path)], label


class ImageFolderDataModule(_GPUPipelineHooks, L.LightningDataModule):
    """ImageNet-layout ``root/train`` and ``root/val`` folders with timm's training and eval transforms.

    Batches are ``(x, y)``: x (B, 3, S, S) float32 normalised with ImageNet's mean/std, y (B,) int64; S is
    ``img_size``, or the requested size for :meth:`eval_dataloader`. ``num_classes`` and ``classes`` are set by
    :meth:`setup`.

    Args:
        root: folder holding ``train/`` and ``val/``, each with one subfolder per class.
        img_size: training and validation image side.
        batch_size: samples per batch (training drops the last incomplete batch, as DeiT does).
        num_workers: DataLoader workers.
        crop_pct: eval centre-crop fraction (1.0: resize to N, centre crop N; 0.875: timm's ImageNet default).
        interpolation: resize interpolation (``bicubic``, ``bilinear``, ``nearest``, ``random``).
        auto_augment: timm RandAugment / AutoAugment policy string, or None / "" for none.
        re_prob: random-erasing probability.
        eval_sizes: sides for :meth:`test_dataloader` (None: ``(img_size,)``).
        seed: seed of the training order and of every training augmentation (a pure function of
            ``(seed, epoch, index)``; the global RNGs are neither used nor changed).
        gpu_pipeline: run the training augmentation batched on the batch's device (see the module doc); training
            batches then leave the DataLoader as ``(x uint8, y, params)`` and become ``(x, y)`` float32 normalised in
            :meth:`on_after_batch_transfer`. ``auto_augment`` must then be a RandAugment policy (``rand-...``) or
            None, and ``interpolation`` one of bicubic, bilinear, random.
        decode_on_device: with ``gpu_pipeline``, decode training JPEGs on the trainer's device when it is a CUDA
            device (nvJPEG); otherwise the workers decode.
    """

    mean, std = IMAGENET_MEAN, IMAGENET_STD
    size_label = "px"

    def __init__(
        self,
        root: str | Path,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 4,
        crop_pct: float = 1.0,
        interpolation: str = "bicubic",
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        re_prob: float = 0.25,
        eval_sizes: Sequence[int] | None = None,
        seed: int = 0,
        gpu_pipeline: bool = False,
        decode_on_device: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(root, (str, Path)):
            raise TypeError(f"root must be a str or Path, got {type(root).__name__}")
        self.root = Path(root)
        root = str(root)  # hparams: a Path would not load under torch.load(weights_only=True)
        self.img_size = _check_int("img_size", img_size)
        self.batch_size = _check_int("batch_size", batch_size)
        self.num_workers = _check_int("num_workers", num_workers, minimum=0)
        if isinstance(crop_pct, bool) or not isinstance(crop_pct, (int, float)) or not 0.0 < crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be a float in (0, 1], got {crop_pct!r}")
        self.crop_pct = float(crop_pct)
        if interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {_INTERPOLATIONS}, got {interpolation!r}")
        self.interpolation = interpolation
        if auto_augment is not None and not isinstance(auto_augment, str):
            raise TypeError(f"auto_augment must be a timm policy string or None, got {type(auto_augment).__name__}")
        self.auto_augment = auto_augment or None
        if isinstance(re_prob, bool) or not isinstance(re_prob, (int, float)) or not 0.0 <= re_prob <= 1.0:
            raise ValueError(f"re_prob must be a float in [0, 1], got {re_prob!r}")
        self.re_prob = float(re_prob)
        self.eval_sizes = (self.img_size,) if eval_sizes is None else _check_int_tuple("eval_sizes", eval_sizes)
        self.seed = _check_int("seed", seed, minimum=0)
        self._set_gpu_pipeline(gpu_pipeline, decode_on_device)
        self.augment: BatchAugment | None = None
        if gpu_pipeline:
            if self.interpolation == "nearest":
                raise ValueError(
                    "interpolation must be bicubic, bilinear or random with gpu_pipeline=True, got 'nearest'"
                )
            if self.auto_augment is not None and not self.auto_augment.startswith("rand"):
                raise ValueError(
                    f"auto_augment must be a RandAugment policy ('rand-...') or None with gpu_pipeline=True, "
                    f"got {self.auto_augment!r}"
                )
            self.augment = BatchAugment(
                self.img_size,
                hflip=0.5,
                rand_augment=self.auto_augment,
                re_prob=self.re_prob,
                mean=IMAGENET_MEAN,
                std=IMAGENET_STD,
            )
        self.save_hyperparameters()
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Scan ``root/train`` and ``root/val``; check both have the same classes."""
        if self.train_dataset is not None:
            return
        if not self.root.is_dir():
            raise ValueError(f"image folder root {self.root} does not exist; expected a folder with train/ and val/")
        train, val = scan_image_folder(self.root / "train"), scan_image_folder(self.root / "val")
        if train.classes != val.classes:
            only_train, only_val = (
                sorted(set(train.classes) - set(val.classes)),
                sorted(set(val.classes) - set(train.classes)),
            )
            raise ValueError(
                f"image folder {self.root}: train/ and val/ must have the same class folders; "
                f"only in train/: {only_train}, only in val/: {only_val}"
            )
        self.classes, self.num_classes = train.classes, len(train.classes)
        self._val_images, self._train_images = val, train
        self.train_transform = create_transform(
            self.img_size,
            is_training=True,
            auto_augment=self.auto_augment,
            re_prob=self.re_prob,
            interpolation=self.interpolation,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
        )
        self.train_dataset = _Transformed(train, self.train_transform, seed=self.seed)
        self.val_dataset = _Transformed(val, self.eval_transform(self.img_size))

    def eval_transform(self, size: int) -> Callable[[Any], torch.Tensor]:
        """timm's eval transform at ``size``: PIL image -> (3, size, size) float32 normalised."""
        size = _check_int("size", size)
        interpolation = "bicubic" if self.interpolation == "random" else self.interpolation
        return create_transform(
            size,
            is_training=False,
            crop_pct=self.crop_pct,
            interpolation=interpolation,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
        )

    def _loader(self, dataset: Dataset, training: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=EpochSampler(len(dataset), self.seed) if training else None,
            shuffle=False,
            drop_last=training,
            num_workers=self.num_workers,
            collate_fn=_collate_samples if isinstance(dataset, _WorkerSamples) else _collate,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, augmented batches, a function of ``(seed, epoch)``; x (B, 3, img_size, img_size).

        With ``gpu_pipeline`` the loader yields ``(x uint8 (B, 3, img_size, img_size), y, params)``, or the
        encoded files when decoding on the device, and the hooks finish the batch on its device.
        """
        self.setup()
        if not self.gpu_pipeline:
            return self._loader(self.train_dataset, training=True)
        samples = self._worker_samples(
            _ImageFiles(self._train_images.samples), len(self._train_images), self.interpolation
        )
        return self._loader(samples, training=True)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """GPU pipeline: ``(x uint8, y, params)`` -> ``(x, y)`` augmented on the batch's device (B, 3, S, S) float32.

        Evaluation batches and the CPU pipeline's batches pass through unchanged.
        """
        if not self.gpu_pipeline:
            return batch
        return _augment_batch(batch, self.augment, self.img_size, clips=False)

    def val_dataloader(self) -> DataLoader:
        """The val folder at ``img_size``; x (B, 3, img_size, img_size)."""
        self.setup()
        return self._loader(self.val_dataset, training=False)

    def eval_dataloader(self, size: int) -> DataLoader:
        """The val folder with the eval transform at ``size``; x (B, 3, size, size)."""
        transform = self.eval_transform(size)
        self.setup()
        return self._loader(_Transformed(self._val_images, transform), training=False)

    def test_dataloader(self) -> list[DataLoader]:
        """One :meth:`eval_dataloader` per entry of ``eval_sizes``, in that order (Lightning's dataloader_idx)."""
        return [self.eval_dataloader(size) for size in self.eval_sizes]
