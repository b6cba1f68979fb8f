"""LightningDataModule serving one multimodal task: training samples at the trained lengths, one test loader
per evaluation length.

Digits are split by ``seed`` (stratified 80/20 as :func:`~experiments.digits.split_digits`): training
samples use the training digits, evaluation samples the held-out ones, so evaluation also measures unseen
handwriting. Every sample is a pure function of ``(seed, stream, length, index)``: all schemes trained with one
seed see the same training sequence and are evaluated on the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from .schemes import get_bench_scheme
from .tasks import TASKS, DigitBank, TaskDataset, collate_samples

__all__ = ["VLMTaskDataModule", "digit_bank"]


@lru_cache(maxsize=8)
def digit_bank(split: str, seed: int, path: str | None = None) -> DigitBank:
    """A cached :class:`DigitBank` (the digits are loaded and resized once per process)."""
    return DigitBank(split, seed, path)


class VLMTaskDataModule(L.LightningDataModule):
    """Batches of one task (dicts from :func:`~experiments.vlm.tasks.collate_samples`).

    Args:
        task: ``grid``, ``multi_image`` or ``video``.
        scheme: the benchmark scheme (only matters for schemes that take video frames as images or tiled images);
            a scheme that does not apply to ``task`` is a ValueError.
        batch_size: training batch size.
        num_train_samples: training samples (= steps x batch size for one pass).
        num_eval_samples: samples per evaluation length.
        eval_lengths: evaluation lengths; default the task's (:data:`~experiments.vlm.tasks.TASKS`).
        eval_batch_size: evaluation batch size; default ``batch_size``.
        seed: the digit split and every sample.
        num_workers: DataLoader workers.
        digits_path: the ``.npz`` to read; default the bundled file.

    Example:
        >>> dm = VLMTaskDataModule("multi_image", batch_size=4, num_train_samples=8, num_eval_samples=4)
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["input_ids"].shape[0], [len(dl.dataset) for dl in dm.test_dataloader()]
        (4, [4, 4, 4, 4, 4])
    """

    def __init__(
        self,
        task: str = "grid",
        scheme: str = "mrope",
        batch_size: int = 32,
        num_train_samples: int = 32000,
        num_eval_samples: int = 200,
        eval_lengths: Sequence[int] | None = None,
        eval_batch_size: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        digits_path: str | Path | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(task, str) or task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
        self.task, self.spec = task, TASKS[task]
        self.scheme = get_bench_scheme(scheme)
        if not self.scheme.applies_to(task):
            raise ValueError(f"scheme {scheme!r} does not apply to task {task!r}: {self.scheme.not_applicable[task]}")
        for name, value, minimum in (
            ("batch_size", batch_size, 1),
            ("num_train_samples", num_train_samples, 1),
            ("num_eval_samples", num_eval_samples, 1),
            ("seed", seed, 0),
            ("num_workers", num_workers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if eval_batch_size is not None and (
            isinstance(eval_batch_size, bool) or not isinstance(eval_batch_size, int) or eval_batch_size < 1
        ):
            raise ValueError(f"eval_batch_size must be a positive int or None, got {eval_batch_size!r}")
        if eval_lengths is None:
            eval_lengths = self.spec.eval_lengths
        if isinstance(eval_lengths, (str, bytes)) or not isinstance(eval_lengths, Sequence) or not eval_lengths:
            raise ValueError(f"eval_lengths must be a non-empty sequence of ints or None, got {eval_lengths!r}")
        bad = [n for n in eval_lengths if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16]
        if self.task == "video":
            bad = [n for n in eval_lengths if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64]
        if bad:
            limit = 64 if self.task == "video" else 16
            raise ValueError(f"eval_lengths must be ints in [1, {limit}] for task {task!r}, got {list(eval_lengths)}")
        if digits_path is not None and not isinstance(digits_path, (str, Path)):
            raise TypeError(f"digits_path must be a str or Path, got {type(digits_path).__name__}")
        self.batch_size, self.num_train_samples, self.num_eval_samples = batch_size, num_train_samples, num_eval_samples
        self.eval_lengths = tuple(eval_lengths)
        self.eval_batch_size = eval_batch_size or batch_size
        self.seed, self.num_workers = seed, num_workers
        self.digits_path = None if digits_path is None else str(digits_path)

    def _loader(self, dataset: TaskDataset, batch_size: int) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=False,  # every index already is an independent random sample
            num_workers=self.num_workers,
            collate_fn=collate_samples,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataset(self) -> TaskDataset:
        bank = digit_bank("train", self.seed, self.digits_path)
        return TaskDataset(
            self.task,
            bank,
            self.spec.train_lengths,
            self.num_train_samples,
            self.seed,
            training=True,
            video_as_images=self.scheme.video_as_images,
            tiled=self.scheme.tiled,
        )

    def eval_dataset(self, length: int) -> TaskDataset:
        bank = digit_bank("val", self.seed, self.digits_path)
        return TaskDataset(
            self.task,
            bank,
            [length],
            self.num_eval_samples,
            self.seed,
            training=False,
            video_as_images=self.scheme.video_as_images,
            tiled=self.scheme.tiled,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset(), self.batch_size)

    def test_dataloader(self) -> list[DataLoader]:
        """One loader per evaluation length, in the order of ``eval_lengths``."""
        return [self._loader(self.eval_dataset(n), self.eval_batch_size) for n in self.eval_lengths]
