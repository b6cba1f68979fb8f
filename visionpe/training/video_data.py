"""Video clips for the tubelet ViTs, stored as folders of frames.

:class:`FrameClipDataModule` yields ``(x, y)`` with x (B, C, T, H, W) float32 normalised and y (B,) int64.

**Frame folders**: ``root/{train,val}/<class>/<clip>/<frame files>``, or per-split index
CSVs (``path,label`` header; ``path`` is the clip folder, relative to ``root`` unless absolute; ``label`` a class
index or a class name). Frames are sorted by natural order of their file names (``frame_2`` before ``frame_10``).
``num_frames`` frames are taken ``stride`` apart, from a random start in training and centred in evaluation. A clip
shorter than the ``(num_frames - 1) * stride + 1`` frames that span needs is padded by repeating its last frame, as
SlowFast/PySlowFast's samplers do (clamped indices), rather than rejected: Something-Something-v2 and Kinetics both
have short clips. A clip folder without any frame file is an error. Training clips (order, start, crop, flip) are a
pure function of ``(seed, epoch, index)``, as the image folders' training samples are; the global RNGs are left alone.

**GPU pipeline** (``gpu_pipeline=True``): as for :class:`~visionpe.training.ImageFolderDataModule`, the workers draw
each clip's start and parameters from its seed, decode the frames to uint8 and resize the clip's one crop box of
every frame to ``img_size`` (bilinear, antialiased), and the flip and normalisation run batched on the batch's
device in :meth:`FrameClipDataModule.on_after_batch_transfer` (:class:`~visionpe.training.gpu_augment.BatchAugment`
on (B, T, C, H, W), the same parameters for every frame of a clip), then the clip is laid out (B, C, T, H, W). With
the trainer on CUDA and ``decode_on_device``, the frames are decoded with nvJPEG in
:meth:`~FrameClipDataModule.on_before_batch_transfer` instead.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import InterpolationMode, v2

from .gpu_augment import BatchAugment, _augment_batch, _collate_samples, _GPUPipelineHooks, _WorkerSamples
from .image_folder import IMAGENET_MEAN, IMAGENET_STD
from .sampling import (
    _TRAIN_STREAM,
    EpochSampler,
    _check_int,
    _check_int_tuple,
    _check_range,
    _collate,
    _one_thread,
    _sample_seed,
    _seeded_rngs,
    _unpack,
)

__all__ = ["FrameClipDataModule", "frame_indices", "list_frames"]

_SPLITS = ("train", "val")


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def list_frames(clip_dir: str | Path) -> list[Path]:
    """The frame files of a clip folder (extensions as torchvision's ``IMG_EXTENSIONS``), in natural name order."""
    if not isinstance(clip_dir, (str, Path)):
        raise TypeError(f"clip_dir must be a str or Path, got {type(clip_dir).__name__}")
    files = [p for p in Path(clip_dir).iterdir() if p.is_file() and p.name.lower().endswith(IMG_EXTENSIONS)]
    return sorted(files, key=lambda p: _natural_key(p.name))


def frame_indices(num_available: int, num_frames: int, stride: int, start: int | None = None) -> torch.Tensor:
    """Indices of ``num_frames`` frames ``stride`` apart; clamped to the last frame when the clip is short.

    Args:
        num_available: frames in the clip (>= 1).
        num_frames: frames to take.
        stride: step between taken frames.
        start: first frame; None centres the span ``(num_frames - 1) * stride + 1`` in the clip.

    Returns:
        (num_frames,) int64.

    Example:
        >>> frame_indices(20, 4, 2).tolist()
        [6, 8, 10, 12]
        >>> frame_indices(5, 4, 2).tolist()
        [0, 2, 4, 4]
    """
    num_available = _check_int("num_available", num_available)
    num_frames, stride = _check_int("num_frames", num_frames), _check_int("stride", stride)
    slack = max(num_available - ((num_frames - 1) * stride + 1), 0)
    if start is None:
        start = slack // 2
    elif not 0 <= _check_int("start", start, minimum=0) <= slack:
        raise ValueError(f"start must be in [0, {slack}] for {num_available} frames, got {start}")
    return (start + stride * torch.arange(num_frames)).clamp(max=num_available - 1)


# --- frame folders ------------------------------------------------------------------------------------------------


def _scan_folders(split_dir: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    if not split_dir.is_dir():
        raise ValueError(f"clip folder {split_dir} does not exist; expected {split_dir}/<class>/<clip>/<frame files>")
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"clip folder {split_dir} has no class folders; expected {split_dir}/<class>/<clip>/<frames>")
    clips, empty = [], []
    for name in classes:
        clip_dirs = sorted((p for p in (split_dir / name).iterdir() if p.is_dir()), key=lambda p: _natural_key(p.name))
        if not clip_dirs:
            empty.append(str(split_dir / name))
        clips.extend((clip_dir, name) for clip_dir in clip_dirs)
    if empty:
        raise ValueError(f"clip folder {split_dir}: class folder(s) without clip folders: {', '.join(empty)}")
    return clips, classes


def _read_index(csv_path: Path, root: Path) -> list[tuple[Path, str]]:
    if not csv_path.is_file():
        raise ValueError(f"index CSV {csv_path} does not exist; expected a CSV with header path,label")
    with csv_path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"path", "label"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"index CSV {csv_path} lacks column(s) {sorted(missing)}; header is {reader.fieldnames}")
        rows = []
        for line, row in enumerate(reader, start=2):
            path, label = (row["path"] or "").strip(), (row["label"] or "").strip()
            if not path or not label:
                raise ValueError(f"index CSV {csv_path} line {line}: empty path or label ({row})")
            clip_dir = Path(path) if Path(path).is_absolute() else root / path
            if not clip_dir.is_dir():
                raise ValueError(f"index CSV {csv_path} line {line}: clip folder {clip_dir} does not exist")
            rows.append((clip_dir, label))
    if not rows:
        raise ValueError(f"index CSV {csv_path} has no rows; expected one clip per row (path,label)")
    return rows


class _FrameClips(Dataset):
    """Clips ``(clip_dir, label)`` as ``(x (C, T, H, W), label)``.

    Items are ``index`` or ``(index, epoch)``. Training clips draw their start and augmentation from the global
    RNGs seeded from ``(seed, epoch, index)`` (see :func:`~visionpe.training.sampling._seeded_rngs`), restored after.
    """

    def __init__(
        self, clips: list[tuple[Path, int]], num_frames: int, stride: int, transform, training: bool, seed: int = 0
    ):
        self.clips, self.num_frames, self.stride = clips, num_frames, stride
        self.transform, self.training, self.seed = transform, training, seed

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, epoch = _unpack(item)
        with _one_thread():
            if not self.training:
                return self._clip(index)
            with _seeded_rngs(_sample_seed(self.seed, _TRAIN_STREAM, epoch, index)):
                return self._clip(index)

    def frame_files(self, index: int) -> tuple[list[Path], int]:
        """The frame files of clip ``index`` (a random start in training, from the global RNGs) and its label."""
        clip_dir, label = self.clips[index]
        files = list_frames(clip_dir)
        if not files:
            raise ValueError(f"clip folder {clip_dir} has no frame files (expected extensions {IMG_EXTENSIONS})")
        start = None
        if self.training:
            slack = max(len(files) - ((self.num_frames - 1) * self.stride + 1), 0)
            start = int(torch.randint(slack + 1, ()))
        return [files[i] for i in frame_indices(len(files), self.num_frames, self.stride, start).tolist()], label

    def _clip(self, index: int) -> tuple[torch.Tensor, int]:
        chosen, label = self.frame_files(index)
        clip_dir = chosen[0].parent
        frames = [v2.functional.pil_to_tensor(Image.open(path).convert("RGB")) for path in chosen]
        sizes = {tuple(frame.shape) for frame in frames}
        if len(sizes) != 1:
            raise ValueError(f"clip folder {clip_dir}: frames differ in size {sorted(sizes)}; expected one size")
        video = self.transform(tv_tensors.Video(torch.stack(frames)))  # (T, C, H, W)
        return video.as_subclass(torch.Tensor).permute(1, 0, 2, 3).contiguous(), label


class FrameClipDataModule(_GPUPipelineHooks, L.LightningDataModule):
    """Video clips stored as folders of frames, sampled with a temporal stride.

    Batches are ``(x, y)``: x (B, 3, num_frames, img_size, img_size) float32 normalised with ImageNet's mean/std,
    y (B,) int64. Training: random start, RandomResizedCrop (``scale``), horizontal flip with probability ``hflip``
    (0 by default: flipping changes the label of direction classes such as Something-Something-v2's "pushing
    something from left to right"). Evaluation: centred start, resize the short side to ``img_size``, centre crop.
    ``classes`` and ``num_classes`` are set by :meth:`setup`. The training order and every training clip (start,
    crop, flip) are a pure function of ``(seed, epoch, index)``: the sampler shuffles per ``(seed, epoch)`` and each
    clip runs with the global RNGs seeded from its own seed and restored after, so a resumed run repeats the
    uninterrupted one whatever the global RNG states.

    Args:
        root: folder with ``train/`` and ``val/`` (``<class>/<clip>/<frame files>``), or the base of the CSV paths.
        num_frames: frames per clip.
        stride: step between sampled frames.
        img_size: output frame side.
        batch_size: clips per batch.
        num_workers: DataLoader workers.
        index_csv: None to scan folders, or a file name containing ``{split}`` (e.g. ``"{split}.csv"``), relative to
            ``root`` unless absolute, giving one CSV per split with header ``path,label``.
        scale: RandomResizedCrop area range for training.
        hflip: horizontal-flip probability for training.
        eval_frames: clip lengths for :meth:`test_dataloader` (None: ``(num_frames,)``).
        seed: seed of the training order and of every training clip's start and augmentation.
        gpu_pipeline: crop on the workers, flip and normalise batched on the batch's device (see the module doc);
            training batches leave the DataLoader as ``(x uint8 (B, T, 3, S, S), y, params)`` and become ``(x, y)``
            in :meth:`on_after_batch_transfer`.
        decode_on_device: with ``gpu_pipeline``, decode training JPEG frames on the trainer's device when it is a
            CUDA device (nvJPEG); otherwise the workers decode.
    """

    mean, std = IMAGENET_MEAN, IMAGENET_STD
    _clips = True  # GPU pipeline batches are (B, T, C, H, W)
    size_label = "frames"

    def __init__(
        self,
        root: str | Path,
        num_frames: int = 8,
        stride: int = 2,
        img_size: int = 112,
        batch_size: int = 8,
        num_workers: int = 2,
        index_csv: str | None = None,
        scale: tuple[float, float] = (0.25, 1.0),
        hflip: float = 0.0,
        eval_frames: Sequence[int] | None = None,
        seed: int = 0,
        gpu_pipeline: bool = False,
        decode_on_device: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(root, (str, Path)):
            raise TypeError(f"root must be a str or Path, got {type(root).__name__}")
        self.root = Path(root)
        root = str(root)  # hparams: a Path would not load under torch.load(weights_only=True)
        self.num_frames = _check_int("num_frames", num_frames)
        self.stride = _check_int("stride", stride)
        self.img_size = _check_int("img_size", img_size)
        self.batch_size = _check_int("batch_size", batch_size)
        self.num_workers = _check_int("num_workers", num_workers, minimum=0)
        if index_csv is not None and (not isinstance(index_csv, str) or "{split}" not in index_csv):
            raise ValueError(f"index_csv must be None or a file name containing '{{split}}', got {index_csv!r}")
        self.index_csv = index_csv
        self.scale = _check_range("scale", scale, 0.0, 1.0)
        if isinstance(hflip, bool) or not isinstance(hflip, (int, float)) or not 0.0 <= hflip <= 1.0:
            raise ValueError(f"hflip must be a probability in [0, 1], got {hflip!r}")
        self.hflip = float(hflip)
        self.eval_frames = (
            (self.num_frames,) if eval_frames is None else _check_int_tuple("eval_frames", eval_frames, minimum=1)
        )
        self.seed = _check_int("seed", seed, minimum=0)
        self._set_gpu_pipeline(gpu_pipeline, decode_on_device)
        # the CPU recipe on the device: RandomResizedCrop (torchvision's ratio range, done on the workers), flip
        self.augment = (
            BatchAugment(self.img_size, scale=self.scale, hflip=self.hflip, rand_augment=None, re_prob=0.0)
            if gpu_pipeline
            else None
        )
        self.save_hyperparameters()
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    def _split_clips(self, split: str) -> list[tuple[Path, str]]:
        if self.index_csv is None:
            return _scan_folders(self.root / split)[0]
        csv_path = Path(self.index_csv.format(split=split))
        return _read_index(csv_path if csv_path.is_absolute() else self.root / csv_path, self.root)

    def _label_map(self, train: list[tuple[Path, str]], val: list[tuple[Path, str]]) -> tuple[dict[str, int], list]:
        """Class index of each label: integer labels are used as they are, names are numbered in sorted order."""
        labels = [label for _, label in train + val]
        if all(label.isdigit() for label in labels):
            num_classes = max(int(label) for label in labels) + 1
            return {label: int(label) for label in labels}, [str(i) for i in range(num_classes)]
        classes = sorted({label for _, label in train})
        unknown = sorted({label for _, label in val} - set(classes))
        if unknown:
            raise ValueError(
                f"clips under {self.root}: val classes {unknown} do not occur in train (classes {classes})"
            )
        return {name: i for i, name in enumerate(classes)}, classes

    def setup(self, stage: str | None = None) -> None:
        """Index both splits; every clip folder must hold at least one frame file."""
        if self.train_dataset is not None:
            return
        if not self.root.is_dir():
            raise ValueError(f"clip root {self.root} does not exist; expected a folder with train/ and val/")
        train, val = self._split_clips("train"), self._split_clips("val")
        label_of, self.classes = self._label_map(train, val)
        self.num_classes = len(self.classes)
        without_frames = [str(clip_dir) for clip_dir, _ in train + val if not list_frames(clip_dir)]
        if without_frames:
            shown = ", ".join(without_frames[:5]) + (
                f" and {len(without_frames) - 5} more" if len(without_frames) > 5 else ""
            )
            raise ValueError(
                f"{len(without_frames)} clip folder(s) without frame files ({shown}); expected {IMG_EXTENSIONS}"
            )
        normalize = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        train_transform = v2.Compose(
            [
                v2.RandomResizedCrop(self.img_size, scale=self.scale, interpolation=InterpolationMode.BILINEAR),
                v2.RandomHorizontalFlip(self.hflip),
                *normalize,
            ]
        )
        self.eval_transform = v2.Compose([v2.Resize(self.img_size), v2.CenterCrop(self.img_size), *normalize])
        self._val_clips = [(clip_dir, label_of[label]) for clip_dir, label in val]
        train_clips = [(clip_dir, label_of[label]) for clip_dir, label in train]
        self.train_dataset = _FrameClips(
            train_clips, self.num_frames, self.stride, train_transform, training=True, seed=self.seed
        )
        self.val_dataset = _FrameClips(self._val_clips, self.num_frames, self.stride, self.eval_transform, False)

    @property
    def eval_sizes(self) -> tuple[int, ...]:
        """The clip lengths of :meth:`test_dataloader` (the sweep's x axis)."""
        return self.eval_frames

    def _loader(self, dataset: Dataset, training: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=EpochSampler(len(dataset), self.seed) if training else None,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=_collate_samples if isinstance(dataset, _WorkerSamples) else _collate,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, augmented clips, a function of ``(seed, epoch)``; x (B, 3, num_frames, img_size, img_size).

        With ``gpu_pipeline`` the loader yields ``(x uint8 (B, num_frames, 3, img_size, img_size), y, params)``, or
        the encoded frames when decoding on the device, and the hooks finish the batch on its device.
        """
        self.setup()
        if not self.gpu_pipeline:
            return self._loader(self.train_dataset, training=True)
        samples = self._worker_samples(self.train_dataset.frame_files, len(self.train_dataset), "bilinear")
        return self._loader(samples, training=True)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """GPU pipeline: ``(x uint8 (B, T, C, S, S), y, params)`` -> ``(x (B, C, T, S, S) float32, y)``.

        Evaluation batches and the CPU pipeline's batches pass through unchanged.
        """
        if not self.gpu_pipeline or not isinstance(batch, (tuple, list)) or len(batch) != 3:
            return batch
        x, labels = _augment_batch(batch, self.augment, self.img_size, clips=True)
        return x.transpose(1, 2), labels

    def val_dataloader(self) -> DataLoader:
        """Val clips, centred sampling; x (B, 3, num_frames, img_size, img_size)."""
        self.setup()
        return self._loader(self.val_dataset, training=False)

    def eval_dataloader(self, num_frames: int) -> DataLoader:
        """Val clips with ``num_frames`` frames, same stride, centred; x (B, 3, num_frames, img_size, img_size)."""
        num_frames = _check_int("num_frames", num_frames)
        self.setup()
        return self._loader(_FrameClips(self._val_clips, num_frames, self.stride, self.eval_transform, False), False)

    def test_dataloader(self) -> list[DataLoader]:
        """One :meth:`eval_dataloader` per entry of ``eval_frames``, in that order (Lightning's dataloader_idx)."""
        return [self.eval_dataloader(num_frames) for num_frames in self.eval_frames]
