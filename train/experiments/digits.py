"""The bundled MNIST digits and the two extrapolation protocols built on them.

``assets/digits/mnist_5k.npz`` holds 5,000 real MNIST digits (500 per class; see ``assets/digits/LICENSE.md``).
:class:`DigitsDataModule` splits them by seed, stratified per class, and serves them under one of two protocols:

- ``resolution``: train at ``img_size`` with RandomResizedCrop (scale and aspect) and a random translation, so
  that digits appear at many sizes as objects do in ImageNet; evaluate at each eval size with timm's eval transform
  (``crop_pct=1.0``: resize to N, centre crop N). The digit fills the same fraction of every image, so at N px it
  spans N / img_size times as many patches as the full view at training time.
- ``canvas``: the digit's ink (its tight bounding box, at most 28x28) is pasted at its native size, one image pixel
  per MNIST pixel, at a random place on a black canvas of ``img_size`` (training) or of each eval size (evaluation,
  places seeded). More tokens, same object scale.

Images are 3-channel float tensors normalised with the MNIST mean and std (:data:`DIGITS_MEAN`,
:data:`DIGITS_STD`, the same value on each channel), so the black background is ``-0.1307 / 0.3081 = -0.4242``.

Determinism: the split depends on ``seed`` only. Training augmentation is a pure function of
``(seed, epoch, index)``: the training sampler shuffles with a generator seeded by ``(seed, epoch)`` and hands each
sample its epoch, and every sample draws its augmentation from its own seed. It does not depend on the global RNG,
``num_workers``, the batch size or the number of DDP processes (Lightning forwards ``set_epoch`` to the sampler).
Evaluation is fixed per ``(seed, size, index)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from PIL import Image
from timm.data import create_transform
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms import InterpolationMode, v2

from visionpe.training.sampling import (
    _EVAL_STREAM,
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

__all__ = [
    "DIGITS_MEAN",
    "DIGITS_PATH",
    "DIGITS_STD",
    "DIGITS_NUM_CLASSES",
    "DigitsDataModule",
    "load_digits",
    "split_digits",
]

# the bundled file, found from this module's place in the repository (train/experiments/ -> assets/digits/)
DIGITS_PATH = Path(__file__).resolve().parents[2] / "assets" / "digits" / "mnist_5k.npz"
DIGITS_MEAN = (0.1307, 0.1307, 0.1307)
DIGITS_STD = (0.3081, 0.3081, 0.3081)
DIGITS_NUM_CLASSES = 10
_DIGIT_PX = 28
_PROTOCOLS = ("resolution", "canvas")


# --- the bundled data ---------------------------------------------------------------------------------------------


def load_digits(path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The bundled MNIST digits.

    Args:
        path: an ``.npz`` with ``images`` (N, 28, 28) uint8 and ``labels`` (N,) ints; default :data:`DIGITS_PATH`.

    Returns:
        ``images`` (N, 28, 28) uint8 and ``labels`` (N,) int64; N = 5000 for the bundled file.

    Example:
        >>> images, labels = load_digits()
        >>> images.shape, images.dtype, labels.shape, labels.unique().tolist()
        (torch.Size([5000, 28, 28]), torch.uint8, torch.Size([5000]), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """
    if path is not None and not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    path = DIGITS_PATH if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"digits file {path} not found; expected the bundled assets/digits/mnist_5k.npz "
            "(rebuild it with `python assets/digits/make_digits.py`)"
        )
    with np.load(path) as data:
        missing = {"images", "labels"} - set(data.files)
        if missing:
            raise ValueError(f"digits file {path} lacks arrays {sorted(missing)}; it has {sorted(data.files)}")
        images, labels = data["images"], data["labels"]
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (_DIGIT_PX, _DIGIT_PX):
        raise ValueError(f"digits file {path}: images must be (N, 28, 28) uint8, got {images.shape} {images.dtype}")
    if labels.shape != (images.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"digits file {path}: labels must be ({images.shape[0]},) ints, got {labels.shape}")
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def split_digits(labels: torch.Tensor, train_fraction: float = 0.8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A stratified random split: in every class, ``round(train_fraction * n_class)`` digits go to training.

    Args:
        labels: (N,) int64 class labels.
        train_fraction: share of each class used for training, in (0, 1).
        seed: the split's seed.

    Returns:
        train and val indices into ``labels``, each sorted, (N_train,) and (N_val,) int64.

    Example:
        >>> train, val = split_digits(torch.arange(10).repeat(10), train_fraction=0.8)
        >>> len(train), len(val), torch.cat([train, val]).unique().numel()
        (80, 20, 100)
    """
    if not isinstance(labels, torch.Tensor) or labels.ndim != 1:
        raise TypeError(f"labels must be a 1D tensor, got {type(labels).__name__} {getattr(labels, 'shape', '')}")
    if isinstance(train_fraction, bool) or not isinstance(train_fraction, (int, float)):
        raise TypeError(f"train_fraction must be a float, got {type(train_fraction).__name__}")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    seed = _check_int("seed", seed, minimum=0)
    generator = torch.Generator().manual_seed(_sample_seed(seed, 2))
    train, val = [], []
    for label in labels.unique(sorted=True):
        members = torch.nonzero(labels == label).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_train = round(train_fraction * len(members))
        if n_train == 0 or n_train == len(members):
            raise ValueError(
                f"train_fraction = {train_fraction} leaves class {int(label)} ({len(members)} samples) "
                "without a train or val sample"
            )
        train.append(members[:n_train])
        val.append(members[n_train:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values


def _ink_boxes(images: torch.Tensor) -> torch.Tensor:
    """(N, 4) int64 ``(top, bottom, left, right)`` of each image's nonzero pixels, half-open; (N, 28, 28) in."""
    rows, cols = images.amax(dim=2) > 0, images.amax(dim=1) > 0
    if not bool(rows.any(dim=1).all()):
        raise ValueError("every digit must have at least one nonzero pixel")
    arange = torch.arange(images.shape[1])
    top = torch.where(rows, arange, images.shape[1]).amin(1)
    bottom = torch.where(rows, arange, -1).amax(1) + 1
    left = torch.where(cols, arange, images.shape[2]).amin(1)
    right = torch.where(cols, arange, -1).amax(1) + 1
    return torch.stack([top, bottom, left, right], dim=1)


# --- datasets -----------------------------------------------------------------------------------------------------


class _DigitsDataset(Dataset):
    """Digits ``indices`` of ``images`` as ``(x, y)``: x (3, size, size) float32 normalised, y int64."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        indices: torch.Tensor,
        protocol: str,
        size: int,
        seed: int,
        training: bool,
        scale: tuple[float, float],
        ratio: tuple[float, float],
        translate: float,
        context: float = 1.0,
    ) -> None:
        self.images, self.labels, self.indices = images, labels, indices
        margin = round(_DIGIT_PX * (context - 1) / 2)
        self.padding = (margin, margin, margin, margin)  # (left, right, top, bottom) of the 28x28 digit
        self.protocol, self.size, self.seed, self.training = protocol, size, seed, training
        self.normalize = v2.Normalize(DIGITS_MEAN, DIGITS_STD)
        if protocol == "canvas":
            self.boxes = _ink_boxes(images[indices])
        elif training:
            self.transform = v2.Compose(
                [
                    v2.RGB(),
                    v2.RandomResizedCrop(size, scale=scale, ratio=ratio, interpolation=InterpolationMode.BICUBIC),
                    v2.RandomAffine(degrees=0.0, translate=(translate, translate)),
                    v2.ToImage(),
                    v2.ToDtype(torch.float32, scale=True),
                    self.normalize,
                ]
            )
        else:
            self.transform = create_transform(
                size, is_training=False, crop_pct=1.0, interpolation="bicubic", mean=DIGITS_MEAN, std=DIGITS_STD
            )

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index, epoch = _unpack(item)
        with _one_thread():
            return self._sample(index, epoch), self.labels[self.indices[index]]

    def _sample(self, index: int, epoch: int) -> torch.Tensor:
        stream_key = (_TRAIN_STREAM, epoch) if self.training else (_EVAL_STREAM, self.size)
        sample_seed = _sample_seed(self.seed, *stream_key, index)
        digit = self.images[self.indices[index]]
        if self.protocol == "resolution" and self.padding[0]:
            digit = torch.nn.functional.pad(digit, self.padding)  # the digit at the centre of a black square
        if self.protocol == "canvas":
            image = self._paste(digit, self.boxes[index], torch.Generator().manual_seed(sample_seed))
        elif self.training:
            with _seeded_rngs(sample_seed):  # the torchvision transforms draw from the global RNG
                image = self.transform(Image.fromarray(digit.numpy()))
        else:
            image = self.transform(Image.fromarray(digit.numpy()).convert("RGB"))
        return image

    def _paste(self, digit: torch.Tensor, box: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        top, bottom, left, right = box.tolist()
        ink = digit[top:bottom, left:right]
        y = int(torch.randint(self.size - ink.shape[0] + 1, (), generator=generator))
        x = int(torch.randint(self.size - ink.shape[1] + 1, (), generator=generator))
        canvas = torch.zeros(1, self.size, self.size, dtype=torch.uint8)
        canvas[0, y : y + ink.shape[0], x : x + ink.shape[1]] = ink
        image = v2.functional.to_dtype(canvas.expand(3, -1, -1), torch.float32, scale=True)
        return self.normalize(image)


class DigitsDataModule(L.LightningDataModule):
    """The bundled MNIST digits under the ``resolution`` or ``canvas`` extrapolation protocol.

    Batches are ``(x, y)``: x (B, 3, S, S) float32 normalised with :data:`DIGITS_MEAN` / :data:`DIGITS_STD`,
    y (B,) int64 in 0..9. S is ``img_size`` for training and ``val_dataloader``, the requested size for
    ``eval_dataloader(size)``.

    Args:
        protocol: ``resolution`` (train with scale/translation augmentation, evaluate resized to each size) or
            ``canvas`` (digit at native scale at a random place; canvas of each size; sizes >= 28).
        img_size: training (and validation) image side.
        eval_sizes: image sides for :meth:`eval_dataloader` and :meth:`test_dataloader`.
        batch_size: samples per batch.
        num_workers: DataLoader workers.
        train_fraction: share of each class used for training (stratified split by ``seed``).
        train_subset: use only the first ``train_subset`` training digits of a seeded permutation (None: all).
        seed: seed of the split, the shuffle and every augmentation.
        scale: RandomResizedCrop area range (``resolution`` training).
        ratio: RandomResizedCrop aspect-ratio range (``resolution`` training).
        translate: largest random shift as a fraction of ``img_size`` (``resolution`` training).
        context: ``resolution`` only: each digit is first centred on a black square ``context`` times its side
            (1.0: the digit fills the image; 2.0: it fills the central half, as an object with background around
            it). With ``scale`` reaching 1 / context**2 the training crops then zoom in on the digit up to
            ``context`` times, so that test sizes up to ``context * img_size`` show it at sizes seen in training
            (the FixRes argument: RandomResizedCrop makes training objects larger than test objects).
        digits_path: the ``.npz`` to read; default the bundled file.

    Example:
        >>> dm = DigitsDataModule(img_size=32, eval_sizes=(32, 64), batch_size=4)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> x.shape, y.shape, len(dm.train_dataset), len(dm.val_dataset)
        (torch.Size([4, 3, 32, 32]), torch.Size([4]), 4000, 1000)
        >>> next(iter(dm.eval_dataloader(64)))[0].shape
        torch.Size([4, 3, 64, 64])
    """

    num_classes = DIGITS_NUM_CLASSES
    mean, std = DIGITS_MEAN, DIGITS_STD
    size_label = "px"

    def __init__(
        self,
        protocol: str = "resolution",
        img_size: int = 32,
        eval_sizes: Sequence[int] = (32, 48, 64, 96, 128),
        batch_size: int = 128,
        num_workers: int = 0,
        train_fraction: float = 0.8,
        train_subset: int | None = None,
        seed: int = 0,
        scale: tuple[float, float] = (0.25, 1.0),
        ratio: tuple[float, float] = (0.75, 1.33),
        translate: float = 0.125,
        context: float = 1.0,
        digits_path: str | Path | None = None,
    ) -> None:
        super().__init__()
        if protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {protocol!r}")
        minimum_size = _DIGIT_PX if protocol == "canvas" else 1
        self.protocol = protocol
        self.img_size = _check_int("img_size", img_size, minimum_size)
        self.eval_sizes = _check_int_tuple("eval_sizes", eval_sizes, minimum_size)
        self.batch_size = _check_int("batch_size", batch_size)
        self.num_workers = _check_int("num_workers", num_workers, minimum=0)
        if isinstance(train_fraction, bool) or not isinstance(train_fraction, (int, float)):
            raise TypeError(f"train_fraction must be a float, got {type(train_fraction).__name__}")
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        self.train_fraction = float(train_fraction)
        self.train_subset = None if train_subset is None else _check_int("train_subset", train_subset)
        self.seed = _check_int("seed", seed, minimum=0)
        self.scale = _check_range("scale", scale, 0.0, 1.0)
        self.ratio = _check_range("ratio", ratio, 0.0, None)
        if isinstance(translate, bool) or not isinstance(translate, (int, float)) or not 0.0 <= translate < 1.0:
            raise ValueError(f"translate must be a float in [0, 1), got {translate!r}")
        self.translate = float(translate)
        if isinstance(context, bool) or not isinstance(context, (int, float)) or not 1.0 <= context <= 8.0:
            raise ValueError(f"context must be a float in [1, 8], got {context!r}")
        if context != 1.0 and protocol != "resolution":
            raise ValueError(f"context applies to protocol='resolution' only, got context={context} with {protocol!r}")
        self.context = float(context)
        if digits_path is not None and not isinstance(digits_path, (str, Path)):
            raise TypeError(f"digits_path must be a str or Path, got {type(digits_path).__name__}")
        self.digits_path = digits_path
        digits_path = None if digits_path is None else str(digits_path)  # hparams: no Path in checkpoints
        self.save_hyperparameters()
        self.train_dataset: _DigitsDataset | None = None
        self.val_dataset: _DigitsDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load the digits and build the split (once; every stage uses the same split)."""
        if self.train_dataset is not None:
            return
        images, labels = load_digits(self.digits_path)
        self.images, self.labels = images, labels
        train_idx, val_idx = split_digits(labels, self.train_fraction, self.seed)
        if self.train_subset is not None:
            if self.train_subset > len(train_idx):
                raise ValueError(f"train_subset = {self.train_subset} exceeds the {len(train_idx)} training digits")
            generator = torch.Generator().manual_seed(_sample_seed(self.seed, 3))
            train_idx = train_idx[torch.randperm(len(train_idx), generator=generator)[: self.train_subset]]
        self.train_indices, self.val_indices = train_idx, val_idx
        self.train_dataset = self._dataset(train_idx, self.img_size, training=True)
        self.val_dataset = self._dataset(val_idx, self.img_size, training=False)

    def _dataset(self, indices: torch.Tensor, size: int, training: bool) -> _DigitsDataset:
        options = {"scale": self.scale, "ratio": self.ratio, "translate": self.translate, "context": self.context}
        return _DigitsDataset(self.images, self.labels, indices, self.protocol, size, self.seed, training, **options)

    def _loader(self, dataset: Dataset, sampler: Sampler | None = None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=_collate,
            persistent_workers=self.num_workers > 0,
        )

    def _require_setup(self) -> None:
        if self.train_dataset is None:
            self.setup()

    def train_dataloader(self) -> DataLoader:
        """Shuffled, augmented training batches at ``img_size``; x (B, 3, img_size, img_size)."""
        self._require_setup()
        return self._loader(self.train_dataset, EpochSampler(len(self.train_dataset), self.seed))

    def val_dataloader(self) -> DataLoader:
        """The val split at ``img_size``, fixed order and content; x (B, 3, img_size, img_size)."""
        self._require_setup()
        return self._loader(self.val_dataset)

    def eval_dataloader(self, size: int) -> DataLoader:
        """The val split at ``size`` (resized, or on a canvas of that size), deterministic; x (B, 3, size, size)."""
        size = _check_int("size", size, _DIGIT_PX if self.protocol == "canvas" else 1)
        self._require_setup()
        return self._loader(self._dataset(self.val_indices, size, training=False))

    def test_dataloader(self) -> list[DataLoader]:
        """One :meth:`eval_dataloader` per entry of ``eval_sizes``, in that order (Lightning's dataloader_idx)."""
        return [self.eval_dataloader(size) for size in self.eval_sizes]
