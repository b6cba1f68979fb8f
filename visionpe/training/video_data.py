"""Video clips for the tubelet ViTs: clips stored as folders of frames, and moving digits made from the bundled MNIST.

Both DataModules yield ``(x, y)`` with x (B, C, T, H, W) float32 normalised and y (B,) int64.

**Frame folders** (:class:`FrameClipDataModule`): ``root/{train,val}/<class>/<clip>/<frame files>``, or per-split index
CSVs (``path,label`` header; ``path`` is the clip folder, relative to ``root`` unless absolute; ``label`` a class
index or a class name). Frames are sorted by natural order of their file names (``frame_2`` before ``frame_10``).
``num_frames`` frames are taken ``stride`` apart, from a random start in training and centred in evaluation. A clip
shorter than the ``(num_frames - 1) * stride + 1`` frames that span needs is padded by repeating its last frame, as
SlowFast/PySlowFast's samplers do (clamped indices), rather than rejected: Something-Something-v2 and Kinetics both
have short clips. A clip folder without any frame file is an error. Training clips (order, start, crop, flip) are a
pure function of ``(seed, epoch, index)``, as the digits' training samples are; the global RNGs are left alone.

**Moving digits** (:class:`MovingDigitsDataModule`): a bundled digit, resized to ``digit_size``, moves at a constant
``speed`` (pixels per frame) in one of the :data:`DIRECTIONS` over a black ``img_size`` canvas that wraps around
(a torus, so a clip of any length stays on screen). The label is ``digit * 4 + direction``: one frame cannot tell
the direction, so the task needs temporal order. Evaluation clips of every length share their digit, start and
motion, so a longer clip is the same clip continued.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import lightning as L
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import InterpolationMode, v2

from .digits import (
    _EVAL_STREAM,
    _TRAIN_STREAM,
    DIGITS_MEAN,
    DIGITS_NUM_CLASSES,
    DIGITS_STD,
    EpochSampler,
    _check_int,
    _check_int_tuple,
    _check_range,
    _collate,
    _one_thread,
    _sample_seed,
    _seeded_rngs,
    _unpack,
    load_digits,
    split_digits,
)
from .image_folder import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "DIRECTIONS",
    "ClipSpec",
    "FrameClipDataModule",
    "MovingDigitsDataModule",
    "frame_indices",
    "list_frames",
]

DIRECTIONS = ("left", "right", "up", "down")
_STEPS = ((0, -1), (0, 1), (-1, 0), (1, 0))  # (dy, dx) per frame for each direction
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

    Items are ``index`` or ``(index, epoch)``. Training clips draw their start and augmentation from the global RNGs
    seeded from ``(seed, epoch, index)`` (see :func:`~visionpe.training.digits._seeded_rngs`), which are restored after.
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

    def _clip(self, index: int) -> tuple[torch.Tensor, int]:
        clip_dir, label = self.clips[index]
        files = list_frames(clip_dir)
        if not files:
            raise ValueError(f"clip folder {clip_dir} has no frame files (expected extensions {IMG_EXTENSIONS})")
        start = None
        if self.training:
            slack = max(len(files) - ((self.num_frames - 1) * self.stride + 1), 0)
            start = int(torch.randint(slack + 1, ()))
        chosen = frame_indices(len(files), self.num_frames, self.stride, start).tolist()
        frames = [v2.functional.pil_to_tensor(Image.open(files[i]).convert("RGB")) for i in chosen]
        sizes = {tuple(frame.shape) for frame in frames}
        if len(sizes) != 1:
            raise ValueError(f"clip folder {clip_dir}: frames differ in size {sorted(sizes)}; expected one size")
        video = self.transform(tv_tensors.Video(torch.stack(frames)))  # (T, C, H, W)
        return video.as_subclass(torch.Tensor).permute(1, 0, 2, 3).contiguous(), label


class FrameClipDataModule(L.LightningDataModule):
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
    """

    mean, std = IMAGENET_MEAN, IMAGENET_STD
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
            collate_fn=_collate,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, augmented clips, a function of ``(seed, epoch)``; x (B, 3, num_frames, img_size, img_size)."""
        self.setup()
        return self._loader(self.train_dataset, training=True)

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


# --- moving digits ------------------------------------------------------------------------------------------------


class ClipSpec(NamedTuple):
    """What a moving-digit clip shows: which digit (index into the bundled file), its motion and its start."""

    digit_index: int
    direction: int
    speed: int
    top: int
    left: int


class _MovingDigits(Dataset):
    """Moving-digit clips ``(x (3, T, S, S), label)`` for the digits ``indices``."""

    def __init__(
        self, module: MovingDigitsDataModule, indices: torch.Tensor, num_clips: int, num_frames: int, training: bool
    ) -> None:
        self.tiles, self.labels, self.indices = module.tiles, module.labels, indices
        self.num_clips, self.num_frames, self.training = num_clips, num_frames, training
        self.img_size, self.speeds, self.seed = module.img_size, module.speeds, module.seed
        self.normalize = v2.Normalize(DIGITS_MEAN, DIGITS_STD)

    def __len__(self) -> int:
        return self.num_clips

    def clip_spec(self, index: int, epoch: int = 0) -> ClipSpec:
        """The digit, motion and start of clip ``index`` (``epoch`` matters for training clips only)."""
        stream_key = (_TRAIN_STREAM, epoch) if self.training else (_EVAL_STREAM, 0)
        generator = torch.Generator().manual_seed(_sample_seed(self.seed, *stream_key, index))
        direction = int(torch.randint(len(DIRECTIONS), (), generator=generator))
        speed = self.speeds[int(torch.randint(len(self.speeds), (), generator=generator))]
        top, left = torch.randint(self.img_size - self.tiles.shape[-1] + 1, (2,), generator=generator).tolist()
        return ClipSpec(int(self.indices[index % len(self.indices)]), direction, speed, top, left)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index, epoch = _unpack(item)
        with _one_thread():
            return self._clip(index, epoch)

    def _clip(self, index: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.clip_spec(index, epoch)
        tile = self.tiles[spec.digit_index]
        canvas = torch.zeros(self.img_size, self.img_size, dtype=torch.uint8)
        canvas[spec.top : spec.top + tile.shape[0], spec.left : spec.left + tile.shape[1]] = tile
        dy, dx = _STEPS[spec.direction]
        frames = torch.stack(
            [canvas.roll((dy * spec.speed * t, dx * spec.speed * t), dims=(0, 1)) for t in range(self.num_frames)]
        )
        video = v2.functional.to_dtype(frames[:, None].expand(-1, 3, -1, -1), torch.float32, scale=True)
        video = self.normalize(tv_tensors.Video(video)).as_subclass(torch.Tensor)  # (T, C, H, W)
        label = self.labels[spec.digit_index] * len(DIRECTIONS) + spec.direction
        return video.permute(1, 0, 2, 3).contiguous(), label


class MovingDigitsDataModule(L.LightningDataModule):
    """Moving bundled digits; the label ``digit * 4 + direction`` needs temporal order.

    Batches are ``(x, y)``: x (B, 3, T, img_size, img_size) float32 normalised with the MNIST mean/std
    (:data:`~visionpe.training.digits.DIGITS_MEAN`), y (B,) int64 in 0..39; T is ``num_frames`` for training and
    ``val_dataloader``, the requested length for :meth:`eval_dataloader`. The digits are split as in
    :class:`~visionpe.training.DigitsDataModule` (same ``seed``, same ``train_fraction``: same split). Training
    clips get a new motion and start every epoch (a pure function of ``(seed, epoch, index)``); val clips are
    fixed, one per val digit.

    Args:
        num_frames: training clip length (>= 2).
        eval_frames: clip lengths for :meth:`test_dataloader`.
        img_size: canvas side.
        batch_size: clips per batch.
        num_clips: training clips per epoch, cycling over the training digits (None: one per training digit).
        seed: seed of the split, the order and every clip.
        digit_size: side the 28x28 digit is resized to.
        speeds: pixels per frame, one drawn per clip.
        train_fraction: share of each class used for training.
        num_workers: DataLoader workers.
        digits_path: the ``.npz`` to read; default the bundled file.

    Example:
        >>> dm = MovingDigitsDataModule(batch_size=2)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> x.shape, y.shape
        (torch.Size([2, 3, 8, 32, 32]), torch.Size([2]))
        >>> next(iter(dm.eval_dataloader(32)))[0].shape
        torch.Size([2, 3, 32, 32, 32])
    """

    num_classes = DIGITS_NUM_CLASSES * len(DIRECTIONS)
    mean, std = DIGITS_MEAN, DIGITS_STD
    size_label = "frames"

    def __init__(
        self,
        num_frames: int = 8,
        eval_frames: Sequence[int] = (8, 16, 32),
        img_size: int = 32,
        batch_size: int = 64,
        num_clips: int | None = None,
        seed: int = 0,
        digit_size: int = 16,
        speeds: Sequence[int] = (1, 2),
        train_fraction: float = 0.8,
        num_workers: int = 0,
        digits_path: str | Path | None = None,
    ) -> None:
        super().__init__()
        self.num_frames = _check_int("num_frames", num_frames, minimum=2)
        self.eval_frames = _check_int_tuple("eval_frames", eval_frames, minimum=2)
        self.img_size = _check_int("img_size", img_size)
        self.batch_size = _check_int("batch_size", batch_size)
        self.num_clips = None if num_clips is None else _check_int("num_clips", num_clips)
        self.seed = _check_int("seed", seed, minimum=0)
        self.digit_size = _check_int("digit_size", digit_size)
        if self.digit_size > self.img_size:
            raise ValueError(f"digit_size = {digit_size} must not exceed img_size = {img_size}")
        self.speeds = _check_int_tuple("speeds", speeds)
        if 2 * max(self.speeds) >= self.img_size:  # the canvas wraps: s and img_size - s look the same way round
            raise ValueError(
                f"speeds must be < img_size / 2 = {self.img_size / 2:g} pixels per frame (beyond, a motion looks like "
                f"the opposite one on the wrapping canvas), got {list(self.speeds)}"
            )
        if isinstance(train_fraction, bool) or not isinstance(train_fraction, (int, float)):
            raise TypeError(f"train_fraction must be a float, got {type(train_fraction).__name__}")
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        self.train_fraction = float(train_fraction)
        self.num_workers = _check_int("num_workers", num_workers, minimum=0)
        if digits_path is not None and not isinstance(digits_path, (str, Path)):
            raise TypeError(f"digits_path must be a str or Path, got {type(digits_path).__name__}")
        self.digits_path = digits_path
        digits_path = None if digits_path is None else str(digits_path)  # hparams: no Path in checkpoints
        self.save_hyperparameters()
        self.train_dataset: _MovingDigits | None = None
        self.val_dataset: _MovingDigits | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load and resize the digits, split them (once)."""
        if self.train_dataset is not None:
            return
        images, self.labels = load_digits(self.digits_path)
        size = [self.digit_size, self.digit_size]
        self.tiles = v2.functional.resize(images[:, None], size, antialias=True)[:, 0]  # (N, d, d) uint8
        self.train_indices, self.val_indices = split_digits(self.labels, self.train_fraction, self.seed)
        num_clips = len(self.train_indices) if self.num_clips is None else self.num_clips
        self.train_dataset = _MovingDigits(self, self.train_indices, num_clips, self.num_frames, training=True)
        self.val_dataset = self._val(self.num_frames)

    @property
    def eval_sizes(self) -> tuple[int, ...]:
        """The clip lengths of :meth:`test_dataloader` (the sweep's x axis)."""
        return self.eval_frames

    def _val(self, num_frames: int) -> _MovingDigits:
        return _MovingDigits(self, self.val_indices, len(self.val_indices), num_frames, training=False)

    def _loader(self, dataset: Dataset, sampler: EpochSampler | None = None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=_collate,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled clips of ``num_frames``; x (B, 3, num_frames, img_size, img_size)."""
        self.setup()
        return self._loader(self.train_dataset, EpochSampler(len(self.train_dataset), self.seed))

    def val_dataloader(self) -> DataLoader:
        """Val clips of ``num_frames``, fixed; x (B, 3, num_frames, img_size, img_size)."""
        self.setup()
        return self._loader(self.val_dataset)

    def eval_dataloader(self, num_frames: int) -> DataLoader:
        """The same val clips continued to ``num_frames``; x (B, 3, num_frames, img_size, img_size)."""
        num_frames = _check_int("num_frames", num_frames, minimum=2)
        self.setup()
        return self._loader(self._val(num_frames))

    def test_dataloader(self) -> list[DataLoader]:
        """One :meth:`eval_dataloader` per entry of ``eval_frames``, in that order (Lightning's dataloader_idx)."""
        return [self.eval_dataloader(num_frames) for num_frames in self.eval_frames]
