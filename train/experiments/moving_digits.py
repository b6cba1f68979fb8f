"""Moving digits: clips made from the bundled MNIST digits, whose label needs temporal order.

:class:`MovingDigitsDataModule` yields ``(x, y)`` with x (B, 3, T, H, W) float32 normalised and y (B,) int64. A
bundled digit, resized to ``digit_size``, moves at a constant ``speed`` (pixels per frame) in one of the
:data:`DIRECTIONS` over a black ``img_size`` canvas that wraps around (a torus, so a clip of any length stays on
screen). The label is ``digit * 4 + direction``: one frame cannot tell the direction, so the task needs temporal
order. Evaluation clips of every length share their digit, start and motion, so a longer clip is the same clip
continued.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from visionpe.training.sampling import (
    _EVAL_STREAM,
    _TRAIN_STREAM,
    EpochSampler,
    _check_int,
    _check_int_tuple,
    _collate,
    _one_thread,
    _sample_seed,
    _unpack,
)

from .digits import DIGITS_MEAN, DIGITS_NUM_CLASSES, DIGITS_STD, load_digits, split_digits

__all__ = ["DIRECTIONS", "ClipSpec", "MovingDigitsDataModule"]

DIRECTIONS = ("left", "right", "up", "down")
_STEPS = ((0, -1), (0, 1), (-1, 0), (1, 0))  # (dy, dx) per frame for each direction


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
    (:data:`~experiments.digits.DIGITS_MEAN`), y (B,) int64 in 0..39; T is ``num_frames`` for training and
    ``val_dataloader``, the requested length for :meth:`eval_dataloader`. The digits are split as in
    :class:`~experiments.digits.DigitsDataModule` (same ``seed``, same ``train_fraction``: same split). Training
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
