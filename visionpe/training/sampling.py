"""Sampling and argument checks shared by the DataModules of :mod:`visionpe.training` (and the experiments' ones).

Determinism: a training sample is a pure function of ``(seed, epoch, index)``. :class:`EpochSampler` shuffles with
a generator seeded by ``(seed, epoch)`` and hands each sample its epoch; each sample then draws its augmentation
from its own seed (:func:`_sample_seed`), with the global RNGs seeded inside :func:`_seeded_rngs` and restored
after. Nothing depends on the global RNG states, ``num_workers``, the batch size or the number of DDP processes
(Lightning forwards ``set_epoch`` to the sampler).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler, default_collate

__all__ = ["EpochSampler"]

_TRAIN_STREAM, _EVAL_STREAM = 0, 1  # seed streams of training and evaluation samples


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_int_tuple(name: str, value: Any, minimum: int = 1) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise TypeError(f"{name} must be a non-empty sequence of ints, got {type(value).__name__} ({value!r})")
    return tuple(_check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value))


def _check_range(name: str, value: Any, low: float, high: float | None) -> tuple[float, float]:
    """A (lo, hi) pair of floats with ``low < lo <= hi`` (and ``hi <= high`` when ``high`` is given)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{name} must be a (min, max) pair of floats, got {type(value).__name__} ({value!r})")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}[{i}] must be a float, got {type(v).__name__} ({v!r})")
    lo, hi = float(value[0]), float(value[1])
    if not (low < lo <= hi) or (high is not None and hi > high):
        bound = f"{low} < min <= max" + (f" <= {high}" if high is not None else "")
        raise ValueError(f"{name} must satisfy {bound}, got ({lo}, {hi})")
    return lo, hi


def _sample_seed(*keys: int) -> int:
    """A 63-bit seed mixed from non-negative integer keys (seed, stream, epoch or size, index)."""
    high, low = np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint32).tolist()
    return (high << 31) ^ low


class EpochSampler(Sampler):
    """Yields ``(index, epoch)`` pairs, shuffled by a generator seeded with ``(seed, epoch)``.

    Lightning calls :meth:`set_epoch` at the start of each epoch (through its ``DistributedSamplerWrapper`` too), so
    the order and the per-sample augmentation seeds follow the epoch, also after a resume from a checkpoint.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True) -> None:
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = _check_int("epoch", epoch, minimum=0)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(_sample_seed(self.seed, _TRAIN_STREAM, self.epoch))
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = range(self.num_samples)
        return ((index, self.epoch) for index in order)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run per-sample transforms on one intra-op thread.

    A sample's tensors are tiny, so extra OpenMP threads only add synchronisation; with ``num_workers=0`` on a busy
    2-core machine that made a 128x128 ``to_tensor`` take 15-35 ms instead of 0.05 ms. DataLoader workers already
    run single-threaded, so this only changes the main-process path.
    """
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


@contextmanager
def _seeded_rngs(sample_seed: int) -> Iterator[None]:
    """Seed Python's ``random``, NumPy's global RNG and torch's CPU RNG from ``sample_seed``; restore all three after.

    Transforms that draw from the global RNGs (timm's RandAugment and RandomResizedCrop use ``random`` and
    ``np.random``, random erasing and torchvision's transforms use torch) then make a pure function of the seed,
    whatever the RNG states around the call, and leave those states as they found them.
    """
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            random.seed(sample_seed)
            np.random.seed([sample_seed & 0xFFFFFFFF, sample_seed >> 32])  # legacy seeds are uint32 words
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _collate(batch: list) -> Any:
    """``default_collate`` on one thread (see :func:`_one_thread`)."""
    with _one_thread():
        return default_collate(batch)


def _unpack(item: int | tuple[int, int]) -> tuple[int, int]:
    """A sampler item as ``(index, epoch)``; plain indices (e.g. Lightning's ``overfit_batches``) are epoch 0."""
    return (int(item[0]), int(item[1])) if isinstance(item, tuple) else (int(item), 0)
