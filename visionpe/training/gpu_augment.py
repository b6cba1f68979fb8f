"""Batched training augmentation on the batch's device, built on kornia: timm's DeiT recipe for images and clips.

:class:`BatchAugment` applies, to a whole batch at once and on whatever device it lives on (the GPU in training, the
CPU in tests): RandomResizedCrop, horizontal flip, RandAugment, normalisation and random erasing, in timm's order
(``create_transform(is_training=True)``). Images are (B, C, H, W), clips (B, T, C, H, W); every frame of a clip gets
the parameters of its clip (one crop box, one flip, the same RandAugment ops and magnitudes, one erased box).

**Where the randomness lives.** Every random draw is a per-sample parameter, drawn on the CPU by
:meth:`BatchAugment.sample_params` (from a ``torch.Generator``, or from torch's global RNG when none is given) with
timm's distributions; the device only applies them. So the same parameters give the same images on every device
(up to floating-point rounding), and a data module can draw each sample's parameters in its DataLoader worker from
that sample's own seed, as its CPU pipeline does (see :class:`~visionpe.training.ImageFolderDataModule`).

**Parameters** (the dict :meth:`~BatchAugment.sample_params` returns, B rows each):

- ``crop`` (B, 4) int64 ``(top, left, height, width)`` in input pixels: timm's
  ``RandomResizedCropAndInterpolation.get_params`` (area fraction uniform in ``scale``, aspect ratio log-uniform in
  ``ratio``, ten tries, then the central crop with the ratio clamped), vectorised by :func:`sample_resized_crop`;
- ``flip`` (B,) bool, true with probability ``hflip``;
- ``ra_op`` (B, n) int64, ``ra_apply`` (B, n) bool, ``ra_level`` (B, n) float32, ``ra_sign`` (B, n) float32: for each
  of RandAugment's n layers the op (uniform, with replacement, per image as timm draws it), whether it runs
  (probability ``p``), its magnitude (``m`` plus Gaussian noise of std ``mstd``, clipped to ``[0, mmax]``) and the
  sign of signed ops;
- ``erase`` (B, 4) int64 ``(top, left, height, width)`` in output pixels and ``erase_apply`` (B,) bool: timm's
  ``RandomErasing`` (one box, area fraction in [0.02, 1/3], log-uniform aspect ratio in [0.3, 1/0.3], ten tries).

**RandAugment.** ``kornia.augmentation.auto.RandAugment`` draws one set of ops for the whole batch, with a fixed
magnitude and no per-op probability, whereas timm draws the ops per image, applies each with probability 0.5 and
adds magnitude noise (``rand-m9-mstd0.5-inc1``, the DeiT policy). :class:`BatchAugment` therefore keeps timm's
policy and its op set (:data:`RAND_AUGMENT_OPS`, the ``inc1`` "increasing" set or the original one) and applies each
op to the images that drew it with kornia's batched functions (``kornia.enhance``: equalize, sharpness;
``kornia.geometry``: rotation matrices, ``warp_affine`` with timm's fill colour; ``crop_and_resize``). Differences to
timm's PIL ops, documented rather than hidden: geometric ops use bilinear sampling (timm: bicubic) and pixel centres
at ``(W - 1) / 2`` for the rotation centre; the ops act on float images, and posterize/solarize round to 8-bit
levels first, as PIL does on its uint8 images. Random erasing fills with zeros after normalisation (timm's ``const``
mode, the default of ``create_transform``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from kornia.color import rgb_to_grayscale
from kornia.enhance import equalize, normalize, sharpness
from kornia.geometry.transform import crop_and_resize, get_rotation_matrix2d, warp_affine
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset, default_collate
from torchvision.io import ImageReadMode, decode_image, decode_jpeg, read_file

from .sampling import _TRAIN_STREAM, _one_thread, _sample_seed, _seeded_rngs, _unpack

__all__ = [
    "RAND_AUGMENT_OPS",
    "BatchAugment",
    "RandAugmentPolicy",
    "parse_rand_augment",
    "decode_resized_crops",
    "decode_rgb",
    "image_size",
    "resized_crops",
    "sample_resized_crop",
]

# timm's two RandAugment op sets (timm.data.auto_augment._RAND_TRANSFORMS and _RAND_INCREASING_TRANSFORMS)
RAND_AUGMENT_OPS = {
    False: (
        "AutoContrast",
        "Equalize",
        "Invert",
        "Rotate",
        "Posterize",
        "Solarize",
        "SolarizeAdd",
        "Color",
        "Contrast",
        "Brightness",
        "Sharpness",
        "ShearX",
        "ShearY",
        "TranslateXRel",
        "TranslateYRel",
    ),
    True: (
        "AutoContrast",
        "Equalize",
        "Invert",
        "Rotate",
        "PosterizeIncreasing",
        "SolarizeIncreasing",
        "SolarizeAdd",
        "ColorIncreasing",
        "ContrastIncreasing",
        "BrightnessIncreasing",
        "SharpnessIncreasing",
        "ShearX",
        "ShearY",
        "TranslateXRel",
        "TranslateYRel",
    ),
}
_LEVEL_DENOM = 10.0  # timm's magnitude scale: level m / 10 of each op's range
_TRANSLATE_PCT = 0.45  # timm's translate_pct default for TranslateXRel / TranslateYRel
_ERASE_AREA, _ERASE_ASPECT = (0.02, 1 / 3), (0.3, 1 / 0.3)  # timm RandomErasing defaults


@dataclass(frozen=True)
class RandAugmentPolicy:
    """A timm RandAugment policy: ``num_layers`` ops per image, each applied with probability ``prob``.

    Attributes:
        magnitude: level m on timm's 0-10 scale.
        num_layers: ops drawn per image (with replacement).
        prob: probability that a drawn op runs.
        magnitude_std: std of the Gaussian noise added to m per op (0: none; ``inf``: uniform in [0, m]).
        magnitude_max: upper clip of the noisy magnitude (timm: 10 unless ``mmax`` is given).
        increasing: use timm's "increasing" op set (``inc1``), whose severity grows with the magnitude.
    """

    magnitude: float = 10.0
    num_layers: int = 2
    prob: float = 0.5
    magnitude_std: float = 0.0
    magnitude_max: float = _LEVEL_DENOM
    increasing: bool = False

    @property
    def ops(self) -> tuple[str, ...]:
        """The op names of this policy, in timm's order (the indices of ``ra_op``)."""
        return RAND_AUGMENT_OPS[self.increasing]


def parse_rand_augment(policy: str) -> RandAugmentPolicy:
    """Read a timm RandAugment string such as ``"rand-m9-mstd0.5-inc1"`` (keys m, n, p, mstd, mmax, inc).

    Args:
        policy: ``"rand"`` followed by dash-separated sections, as ``timm.data.rand_augment_transform`` reads them;
            ``mstd`` above 100 means uniform magnitudes, as in timm. Weighted op sets (``t...``) are not supported.

    Returns:
        the :class:`RandAugmentPolicy`.

    Raises:
        TypeError: ``policy`` is not a str.
        ValueError: naming ``policy``, for another augment family (``augmix``, AutoAugment), an unknown or
            malformed section, or values out of range.

    Example:
        >>> parse_rand_augment("rand-m9-mstd0.5-inc1")
        RandAugmentPolicy(magnitude=9.0, num_layers=2, prob=0.5, magnitude_std=0.5, magnitude_max=10.0, increasing=True)
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a timm RandAugment string such as 'rand-m9-mstd0.5-inc1', got {policy!r}")
    sections = policy.split("-")
    if sections[0] != "rand":
        raise ValueError(f"policy must start with 'rand' (timm RandAugment), got {policy!r}")
    values: dict[str, Any] = {}
    for section in sections[1:]:
        match = re.fullmatch(r"(mstd|mmax|inc|m|n|p)(\d+(?:\.\d*)?)", section)
        if match is None:
            raise ValueError(
                f"policy {policy!r}: section {section!r} is not one of m<level>, n<layers>, p<prob>, mstd<std>, "
                "mmax<max>, inc<0|1>"
            )
        key, number = match.group(1), float(match.group(2))
        if key == "m":
            values["magnitude"] = number
        elif key == "n":
            values["num_layers"] = int(number)
        elif key == "p":
            values["prob"] = number
        elif key == "mstd":
            values["magnitude_std"] = math.inf if number > 100 else number
        elif key == "mmax":
            values["magnitude_max"] = number
        else:
            values["increasing"] = bool(int(number))
    result = RandAugmentPolicy(**values)
    if result.num_layers < 1 or not 0.0 <= result.prob <= 1.0 or result.magnitude_max <= 0:
        raise ValueError(f"policy {policy!r}: expected n >= 1, p in [0, 1] and mmax > 0, got {result}")
    return result


def _check_prob(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} ({value!r})")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def _check_pair(name: str, value: Any, low: float, high: float | None) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{name} must be a (min, max) pair of floats, got {type(value).__name__} ({value!r})")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise TypeError(f"{name} must hold two floats, got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if not low < lo <= hi or (high is not None and hi > high):
        bound = f"{low} < min <= max" + (f" <= {high}" if high is not None else "")
        raise ValueError(f"{name} must satisfy {bound}, got ({lo}, {hi})")
    return lo, hi


def _check_sizes(heights: Any, widths: Any) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = []
    for name, value in (("heights", heights), ("widths", widths)):
        tensor = torch.as_tensor(value)
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.dim() != 1 or len(tensor) == 0:
            raise TypeError(f"{name} must be a non-empty 1-D sequence of ints, got {value!r}")
        if (tensor < 1).any():
            raise ValueError(f"{name} must all be >= 1, got {tensor.tolist()}")
        sizes.append(tensor.to("cpu", torch.int64))
    if sizes[0].shape != sizes[1].shape:
        raise ValueError(f"heights and widths must have the same length, got {len(sizes[0])} and {len(sizes[1])}")
    return sizes[0], sizes[1]


def _first_valid(valid: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row, the entries of ``values`` at the first true column of ``valid`` (B, tries); zeros where none is."""
    first = torch.where(valid.any(1), valid.float().argmax(1), 0)[:, None]
    return tuple(value.gather(1, first)[:, 0] for value in values)


def _box_tries(
    area: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float], generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's 10 tries of a box per sample (RandomResizedCrop, RandomErasing): a target area uniform in ``scale``
    times ``area`` (B, 1), an aspect log-uniform in ``ratio``; the sides ``round(sqrt(target * aspect))`` and
    ``round(sqrt(target / aspect))``, each (B, 10), in that order (crops call them width and height, erasing the
    other way round, as timm does)."""
    batch, tries = len(area), 10
    u_area = torch.rand(batch, tries, generator=generator, dtype=torch.float64)
    u_ratio = torch.rand(batch, tries, generator=generator, dtype=torch.float64)
    target = (scale[0] + (scale[1] - scale[0]) * u_area) * area
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)
    return torch.round(torch.sqrt(target * aspect)).long(), torch.round(torch.sqrt(target / aspect)).long()


def _randint(high: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One uniform integer in ``[0, high]`` per entry (``random.randint(0, high)``)."""
    u = torch.rand(high.shape, generator=generator, dtype=torch.float64)
    return torch.minimum((u * (high + 1)).long(), high)


def sample_resized_crop(
    heights: Sequence[int] | torch.Tensor,
    widths: Sequence[int] | torch.Tensor,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """timm's RandomResizedCrop boxes for B images of the given sizes, drawn at once on the CPU.

    The algorithm of ``timm.data.transforms.RandomResizedCropAndInterpolation.get_params``: up to ten tries of an
    area fraction uniform in ``scale`` and an aspect ratio ``exp(U(log ratio))``, rounded to whole pixels, the first
    that fits taken at a uniform position; none fits: the central crop, its ratio clamped to ``ratio``.

    Args:
        heights: (B,) image heights in pixels.
        widths: (B,) image widths in pixels.
        scale: range of the crop's area as a fraction of the image's.
        ratio: range of the crop's width / height.
        generator: CPU generator of the draws; None uses torch's global RNG.

    Returns:
        (B, 4) int64 ``(top, left, height, width)``.

    Raises:
        TypeError / ValueError: naming the argument, for sizes that are not positive ints, or malformed ranges.
    """
    heights, widths = _check_sizes(heights, widths)
    scale, ratio = _check_pair("scale", scale, 0.0, 1.0), _check_pair("ratio", ratio, 0.0, None)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    H, W = heights.double()[:, None], widths.double()[:, None]
    w, h = _box_tries(H * W, scale, ratio, generator)
    valid = (w <= W.long()) & (h <= H.long())
    h, w = _first_valid(valid, h, w)
    found = valid.any(1)
    # fallback: the central crop with the ratio clamped (timm)
    in_ratio = widths.double() / heights.double()
    fallback_w = torch.where(in_ratio > max(ratio), torch.round(heights.double() * max(ratio)).long(), widths).clamp(
        1, None
    )
    fallback_h = torch.where(in_ratio < min(ratio), torch.round(widths.double() / min(ratio)).long(), heights).clamp(
        1, None
    )
    h, w = torch.where(found, h, fallback_h), torch.where(found, w, fallback_w)
    top = torch.where(found, _randint(heights - h, generator), (heights - h) // 2)
    left = torch.where(found, _randint(widths - w, generator), (widths - w) // 2)
    return torch.stack([top, left, h, w], dim=1)


def resized_crops(
    images: torch.Tensor | Sequence[torch.Tensor],
    boxes: torch.Tensor,
    size: int,
    interpolation: str | Sequence[str] = "bilinear",
    antialias: bool = True,
) -> torch.Tensor:
    """Crop box i out of image i and resize it to ``size`` x ``size``, on the images' device.

    Args:
        images: (B, C, H, W) or a list of B tensors (C, H, W) / (T, C, H, W) of any sizes (every frame of an entry
            is cropped with its box); uint8 or float.
        boxes: (B, 4) int ``(top, left, height, width)`` in each image's pixels.
        size: output side.
        interpolation: ``bilinear`` or ``bicubic`` (``torch.nn.functional.interpolate`` modes), or one per image.
        antialias: low-pass when shrinking (as PIL and torchvision's resize do).

    Returns:
        (B, C, size, size), or (B, T, C, size, size) for a list of clips, the input dtype (uint8 rounded and
        clamped).

    Raises:
        TypeError / ValueError: naming the argument, for a wrong type, shape, box outside its image or mode.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if isinstance(images, torch.Tensor):
        if images.dim() != 4:
            raise ValueError(f"images must be (B, C, H, W) or a list of images, got shape {tuple(images.shape)}")
        images = list(images)
    elif not isinstance(images, Sequence) or not all(isinstance(image, torch.Tensor) for image in images):
        raise TypeError(f"images must be a tensor or a sequence of tensors, got {type(images).__name__}")
    modes = [interpolation] * len(images) if isinstance(interpolation, str) else list(interpolation)
    if len(modes) != len(images) or any(mode not in ("bilinear", "bicubic") for mode in modes):
        raise ValueError(
            f"interpolation must be 'bilinear' or 'bicubic', or one of them per image, got {interpolation!r}"
        )
    if not isinstance(boxes, torch.Tensor) or boxes.shape != (len(images), 4):
        raise ValueError(f"boxes must be a ({len(images)}, 4) tensor (top, left, height, width), got {boxes!r}")
    out = []
    for image, (top, left, height, width), mode in zip(images, boxes.tolist(), modes, strict=True):
        if image.dim() not in (3, 4):
            raise ValueError(f"images must be (C, H, W) or (T, C, H, W) each, got shape {tuple(image.shape)}")
        H, W = image.shape[-2:]
        if top < 0 or left < 0 or height < 1 or width < 1 or top + height > H or left + width > W:
            raise ValueError(f"boxes: ({top}, {left}, {height}, {width}) does not fit an image of {H}x{W}")
        crop = image[..., top : top + height, left : left + width]
        frames = crop if crop.dim() == 4 else crop[None]
        if image.dtype == torch.uint8 and image.device.type == "cpu":  # torch's uint8 kernels: 5x the float path
            resized = F.interpolate(frames, size=(size, size), mode=mode, antialias=antialias, align_corners=False)
        else:
            resized = F.interpolate(frames.float(), (size, size), mode=mode, antialias=antialias, align_corners=False)
            if image.dtype == torch.uint8:
                resized = resized.round_().clamp_(0, 255).to(torch.uint8)
        out.append(resized if crop.dim() == 4 else resized[0])
    return torch.stack(out)


# --- RandAugment ops on float images in [0, 1], (N, C, H, W), one magnitude per image ---------------------------


def _to_levels(x: torch.Tensor) -> torch.Tensor:
    return (x * 255).round()


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (degenerate + factor[:, None, None, None] * (x - degenerate)).clamp(0, 1)


def _auto_contrast(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(dim=(-2, -1), keepdim=True), x.amax(dim=(-2, -1), keepdim=True)
    span = hi - lo
    return torch.where(span > 0, (x - lo) / span.clamp_min(1e-12), x)


def _posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    shift = (8 - bits.long().clamp(0, 8))[:, None, None, None]
    levels = _to_levels(x).long()
    return ((levels >> shift) << shift).to(x.dtype) / 255


def _solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return torch.where(_to_levels(x) >= threshold[:, None, None, None], 1 - x, x)


def _solarize_add(x: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    levels = _to_levels(x)
    return torch.where(levels < 128, (levels + add[:, None, None, None]).clamp(max=255) / 255, x)


def _grey(x: torch.Tensor) -> torch.Tensor:
    return rgb_to_grayscale(x) if x.shape[1] == 3 else x.mean(1, keepdim=True)


def _contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    mean = (_to_levels(_grey(x)).mean(dim=(1, 2, 3)) + 0.5).floor() / 255  # PIL: int(mean + 0.5) of the L image
    return _blend(mean[:, None, None, None].expand_as(x), x, factor)


def _warp(x: torch.Tensor, matrix: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``x`` warped by forward affine maps (N, 2, 3) in pixel coordinates, uncovered pixels set to ``fill``."""
    return warp_affine(
        x, matrix, x.shape[-2:], padding_mode="fill", fill_value=fill.to(x.device, x.dtype), align_corners=True
    )


def _affine(kind: str, x: torch.Tensor, value: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    n, _, H, W = x.shape
    matrix = torch.eye(3, dtype=x.dtype, device=x.device).repeat(n, 1, 1)[:, :2]
    value = value.to(x.dtype)
    if kind == "Rotate":  # degrees, counter-clockwise about the centre (PIL's rotate)
        # filled on the device: a tensor built from Python numbers would be a blocking host-to-device copy
        center = torch.stack([x.new_full((n,), (W - 1) / 2), x.new_full((n,), (H - 1) / 2)], dim=1)
        matrix = get_rotation_matrix2d(center, value, torch.ones(n, 2, dtype=x.dtype, device=x.device))
    elif kind == "ShearX":  # PIL AFFINE (1, s, 0, 0, 1, 0) maps output to input: x_in = x + s y
        matrix[:, 0, 1] = -value
    elif kind == "ShearY":
        matrix[:, 1, 0] = -value
    elif kind == "TranslateXRel":  # x_in = x + t W
        matrix[:, 0, 2] = -value * W
    else:  # TranslateYRel
        matrix[:, 1, 2] = -value * H
    return _warp(x, matrix, fill)


def _level_arg(name: str, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """timm's ``LEVEL_TO_ARG`` for op ``name``, vectorised: the op's argument from its level (0-10) and sign."""
    frac = level / _LEVEL_DENOM
    if name == "Rotate":
        return frac * 30 * sign
    if name in ("ShearX", "ShearY"):
        return frac * 0.3 * sign
    if name in ("TranslateXRel", "TranslateYRel"):
        return frac * _TRANSLATE_PCT * sign
    if name == "Posterize":
        return (frac * 4).floor()
    if name == "PosterizeIncreasing":
        return 4 - (frac * 4).floor()
    if name == "Solarize":
        return (frac * 256).floor().clamp(max=256)
    if name == "SolarizeIncreasing":
        return 256 - (frac * 256).floor().clamp(max=256)
    if name == "SolarizeAdd":
        return (frac * 110).floor().clamp(max=128)
    if name.endswith("Increasing"):  # Color/Contrast/Brightness/Sharpness: 1 -/+ up to 0.9, at least 0.1
        return (1 + frac * 0.9 * sign).clamp(min=0.1)
    return frac * 1.8 + 0.1  # Color, Contrast, Brightness, Sharpness


def _apply_op(name: str, x: torch.Tensor, arg: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    arg = arg.to(x.device)
    if name == "AutoContrast":
        return _auto_contrast(x)
    if name == "Equalize":
        return equalize(x)
    if name == "Invert":
        return 1 - x
    if name in ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"):
        return _affine(name, x, arg, fill)
    if name.startswith("Posterize"):
        return _posterize(x, arg)
    if name.startswith("SolarizeAdd"):
        return _solarize_add(x, arg)
    if name.startswith("Solarize"):
        return _solarize(x, arg)
    factor = arg.to(x.dtype)
    if name.startswith("Color"):
        return _blend(_grey(x).expand_as(x), x, factor)
    if name.startswith("Contrast"):
        return _contrast(x, factor)
    if name.startswith("Brightness"):
        return _blend(torch.zeros_like(x), x, factor)
    return sharpness(x, factor)  # Sharpness: PIL's 3x3 smoothing kernel, borders kept


class BatchAugment(torch.nn.Module):
    """timm's training augmentation for a batch of images or clips, on the batch's device (see the module doc).

    Order: RandomResizedCrop to ``size`` (skipped when the parameters carry no ``crop``: the input is then already
    ``size`` x ``size``, as the data modules' workers deliver it), horizontal flip, RandAugment, conversion to float
    and normalisation with ``mean`` / ``std``, random erasing (zeros).

    Args:
        size: output side S.
        scale: RandomResizedCrop area range (timm's default (0.08, 1)).
        ratio: RandomResizedCrop aspect-ratio range, sampled log-uniformly (timm's default (3/4, 4/3)).
        hflip: horizontal-flip probability.
        rand_augment: a timm RandAugment string (``"rand-m9-mstd0.5-inc1"``, DeiT's), a :class:`RandAugmentPolicy`,
            or None for none.
        re_prob: random-erasing probability.
        mean: per-channel mean of the normalisation (ImageNet's by default).
        std: per-channel std of the normalisation.
        interpolation: crop resize mode, ``bilinear`` or ``bicubic``.

    Shapes:
        input: (B, C, H, W) or (B, T, C, H, W), uint8 in [0, 255] or float in [0, 1].
        output: (B, C, S, S) or (B, T, C, S, S) float32, normalised.
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
        rand_augment: str | RandAugmentPolicy | None = "rand-m9-mstd0.5-inc1",
        re_prob: float = 0.25,
        mean: Sequence[float] = tuple(IMAGENET_DEFAULT_MEAN),
        std: Sequence[float] = tuple(IMAGENET_DEFAULT_STD),
        interpolation: str = "bilinear",
    ) -> None:
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an int, got {type(size).__name__} ({size!r})")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.scale = _check_pair("scale", scale, 0.0, 1.0)
        self.ratio = _check_pair("ratio", ratio, 0.0, None)
        self.hflip = _check_prob("hflip", hflip)
        if rand_augment is None or rand_augment == "":
            self.policy = None
        elif isinstance(rand_augment, RandAugmentPolicy):
            self.policy = rand_augment
        elif isinstance(rand_augment, str):
            self.policy = parse_rand_augment(rand_augment)
        else:
            raise TypeError(
                f"rand_augment must be a timm RandAugment string, a RandAugmentPolicy or None, "
                f"got {type(rand_augment).__name__}"
            )
        self.re_prob = _check_prob("re_prob", re_prob)
        for name, values in (("mean", mean), ("std", std)):
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
                raise TypeError(f"{name} must be a sequence of floats (one per channel), got {values!r}")
        if len(mean) != len(std) or any(float(s) <= 0 for s in std):
            raise ValueError(f"mean and std must have one entry per channel and std > 0, got {mean!r} and {std!r}")
        if interpolation not in ("bilinear", "bicubic"):
            raise ValueError(f"interpolation must be 'bilinear' or 'bicubic', got {interpolation!r}")
        self.interpolation = interpolation
        self.register_buffer("mean", torch.tensor([float(m) for m in mean]), persistent=False)
        self.register_buffer("std", torch.tensor([float(s) for s in std]), persistent=False)
        # timm fills uncovered pixels of geometric ops with the mean colour rounded to 8 bits (its img_mean)
        self.register_buffer("fill", torch.tensor([min(255, round(255 * float(m))) / 255 for m in mean]), False)

    def extra_repr(self) -> str:
        return (
            f"size={self.size}, scale={self.scale}, ratio={self.ratio}, hflip={self.hflip}, "
            f"rand_augment={self.policy}, re_prob={self.re_prob}"
        )

    def sample_params(
        self,
        batch_size: int,
        heights: Sequence[int] | torch.Tensor | None = None,
        widths: Sequence[int] | torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """Draw the parameters of ``batch_size`` samples on the CPU (the keys are listed in the module doc).

        Args:
            batch_size: B.
            heights: (B,) input heights for the crop boxes; None (with ``widths`` None) draws no ``crop``, for
                inputs that are already ``size`` x ``size``.
            widths: (B,) input widths.
            generator: CPU generator of every draw; None uses torch's global RNG.

        Returns:
            dict of CPU tensors with B rows each.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if (heights is None) != (widths is None):
            raise ValueError("heights and widths must both be given (input sizes) or both be None (no crop)")
        params: dict[str, torch.Tensor] = {}
        if heights is not None:
            params["crop"] = sample_resized_crop(heights, widths, self.scale, self.ratio, generator)
            if len(params["crop"]) != batch_size:
                raise ValueError(f"heights and widths must have batch_size={batch_size} entries")
        params["flip"] = torch.rand(batch_size, generator=generator) < self.hflip
        if self.policy is not None:
            policy, n = self.policy, self.policy.num_layers
            params["ra_op"] = torch.randint(len(policy.ops), (batch_size, n), generator=generator)
            params["ra_apply"] = torch.rand(batch_size, n, generator=generator) <= policy.prob
            level = torch.full((batch_size, n), float(policy.magnitude))
            if math.isinf(policy.magnitude_std):
                level = torch.rand(batch_size, n, generator=generator) * policy.magnitude
            elif policy.magnitude_std > 0:
                level = level + policy.magnitude_std * torch.randn(batch_size, n, generator=generator)
            params["ra_level"] = level.clamp(0.0, policy.magnitude_max)
            params["ra_sign"] = torch.where(torch.rand(batch_size, n, generator=generator) > 0.5, -1.0, 1.0)
        size = torch.full((batch_size,), self.size, dtype=torch.int64)
        params["erase_apply"] = torch.rand(batch_size, generator=generator) < self.re_prob
        params["erase"] = self._sample_erase(size, generator)
        return params

    def _sample_erase(self, size: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """timm's RandomErasing box (count 1) per sample: (B, 4) ``(top, left, h, w)``, h = 0 when no try fits."""
        h, w = _box_tries((size * size).double()[:, None], _ERASE_AREA, _ERASE_ASPECT, generator)
        valid = (w < size[:, None]) & (h < size[:, None])
        h, w = _first_valid(valid, h, w)
        found = valid.any(1)
        h, w = torch.where(found, h, 0), torch.where(found, w, 0)
        return torch.stack([_randint(size - h, generator), _randint(size - w, generator), h, w], dim=1)

    def forward(
        self,
        x: torch.Tensor,
        params: dict[str, torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Augment a batch.

        Args:
            x: (B, C, H, W) images or (B, T, C, H, W) clips, uint8 or float in [0, 1], on any device.
            params: per-sample parameters from :meth:`sample_params` (on any device); None draws them here from
                ``generator`` (with crop boxes for the input's H x W).
            generator: CPU generator used when ``params`` is None; None uses torch's global RNG.

        Returns:
            (B, C, S, S) or (B, T, C, S, S) float32, normalised.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor (B, C, H, W) or (B, T, C, H, W), got {type(x).__name__}")
        if x.dim() not in (4, 5):
            raise ValueError(f"x must be (B, C, H, W) or (B, T, C, H, W), got shape {tuple(x.shape)}")
        if x.dtype != torch.uint8 and not x.dtype.is_floating_point:
            raise TypeError(f"x must be uint8 or floating point, got {x.dtype}")
        channels = x.shape[-3]
        if channels != len(self.mean):
            raise ValueError(f"x has {channels} channels, mean/std have {len(self.mean)}")
        batch, H, W = x.shape[0], x.shape[-2], x.shape[-1]
        if params is None:
            params = self.sample_params(batch, [H] * batch, [W] * batch, generator)
        elif not isinstance(params, dict):
            raise TypeError(f"params must be a dict from sample_params, got {type(params).__name__}")
        missing = {"flip", "erase", "erase_apply"} - set(params) | (
            {"ra_op", "ra_apply", "ra_level", "ra_sign"} - set(params) if self.policy is not None else set()
        )
        if missing:
            raise ValueError(f"params lacks {sorted(missing)}; expected the dict of sample_params")
        wrong = {key: tuple(value.shape) for key, value in params.items() if len(value) != batch}
        if wrong:
            raise ValueError(f"params must have {batch} rows (the batch size), got shapes {wrong}")
        frames = 1 if x.dim() == 4 else x.shape[1]
        flat = x.reshape(batch * frames, channels, H, W)

        def per_frame(value: torch.Tensor) -> torch.Tensor:  # CPU parameters: copied without waiting for the device
            return value.to(flat.device, non_blocking=True).repeat_interleave(frames, dim=0)

        if "crop" in params:
            flat = self._crop(flat, per_frame(params["crop"]))
        elif (H, W) != (self.size, self.size):
            raise ValueError(f"x must be {self.size}x{self.size} when params carry no crop, got {H}x{W}")
        flat = flat.float() / 255 if flat.dtype == torch.uint8 else flat.float()
        flip = per_frame(params["flip"]).bool()[:, None, None, None]
        flat = torch.where(flip, flat.flip(-1), flat)
        if self.policy is not None:
            # which rows run which op is read on the host: from CPU parameters without a device sync
            ops = torch.where(params["ra_apply"].bool(), params["ra_op"], -1).cpu().repeat_interleave(frames, dim=0)
            flat = self._rand_augment(flat, ops, per_frame(params["ra_level"]), per_frame(params["ra_sign"]))
        mean, std = (value.to(flat.device, non_blocking=True) for value in (self.mean, self.std))
        flat = normalize(flat, mean, std)
        flat = flat * ~self._erase_mask(per_frame(params["erase"]), per_frame(params["erase_apply"]).bool())
        out = flat.view(batch, frames, channels, self.size, self.size)
        return out[:, 0] if x.dim() == 4 else out

    def _crop(self, x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """Batched crop and resize with kornia (all inputs one size); (N, C, H, W) -> (N, C, S, S)."""
        top, left, h, w = boxes.to(torch.float32).unbind(1)
        corners = torch.stack(
            [
                torch.stack([left, top], 1),
                torch.stack([left + w - 1, top], 1),
                torch.stack([left + w - 1, top + h - 1], 1),
                torch.stack([left, top + h - 1], 1),
            ],
            dim=1,
        )
        out = crop_and_resize(x.float(), corners, (self.size, self.size), mode=self.interpolation)
        return out.round_().clamp_(0, 255).to(torch.uint8) if x.dtype == torch.uint8 else out

    def _rand_augment(
        self, x: torch.Tensor, ops: torch.Tensor, level: torch.Tensor, sign: torch.Tensor
    ) -> torch.Tensor:
        """Per layer, each op runs on the images that drew it (``ops`` on the CPU, -1: none) at their magnitudes."""
        fill = self.fill.to(x.device, non_blocking=True)
        for layer in range(ops.shape[1]):
            for index, name in enumerate(self.policy.ops):
                host_rows = (ops[:, layer] == index).nonzero()[:, 0]
                if len(host_rows) == 0:
                    continue
                rows = host_rows.to(x.device, non_blocking=True)
                arg = _level_arg(name, level[rows, layer].float(), sign[rows, layer].float())
                x = x.index_copy(0, rows, _apply_op(name, x[rows], arg, fill).to(x.dtype))
        return x

    def _erase_mask(self, boxes: torch.Tensor, apply: torch.Tensor) -> torch.Tensor:
        """(N, 1, S, S) bool, true inside each applied erase box."""
        coords = torch.arange(self.size, device=boxes.device)
        top, left, h, w = (value[:, None] for value in boxes.unbind(1))
        rows = (coords >= top) & (coords < top + h)
        cols = (coords >= left) & (coords < left + w)
        return (rows[:, :, None] & cols[:, None, :] & apply[:, None, None])[:, None]


# --- decoding: in DataLoader workers, or on the trainer's CUDA device ----------------------------------------------


def image_size(path: str | Path) -> tuple[int, int]:
    """``(height, width)`` of an image file, read from its header only (PIL opens files lazily)."""
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    with Image.open(path) as image:
        width, height = image.size
    return height, width


def _is_jpeg(data: torch.Tensor) -> bool:
    return len(data) > 2 and int(data[0]) == 0xFF and int(data[1]) == 0xD8


def decode_rgb(data: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decode one encoded image (1-D uint8 file bytes) to (3, H, W) uint8 RGB.

    JPEGs are decoded with ``torchvision.io.decode_jpeg`` on ``device`` (nvJPEG on a CUDA device); other formats,
    and JPEGs that the device decoder refuses (CMYK, for one), on the CPU and then moved to ``device``.
    """
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"data must be a 1-D uint8 tensor of file bytes, got {data!r:.80}")
    device = torch.device(device)
    if device.type == "cuda" and _is_jpeg(data):
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            pass
    return decode_image(data, mode=ImageReadMode.RGB).to(device)


def decode_resized_crops(
    encoded: Sequence[Sequence[torch.Tensor]],
    boxes: torch.Tensor,
    size: int,
    device: torch.device | str,
    interpolation: str | Sequence[str] = "bilinear",
) -> torch.Tensor:
    """Decode B samples of T encoded frames each on ``device`` and crop box i out of every frame of sample i.

    JPEG frames are decoded in one batched ``decode_jpeg`` call on a CUDA ``device`` (nvJPEG), anything else as
    :func:`decode_rgb` does.

    Args:
        encoded: B sequences of T 1-D uint8 tensors (file bytes, on the CPU), T the same for every sample.
        boxes: (B, 4) ``(top, left, height, width)`` in each sample's frame pixels.
        size: output side.
        device: where to decode and resize.
        interpolation: resize mode, or one per sample (see :func:`resized_crops`).

    Returns:
        (B, T, 3, size, size) uint8 on ``device``.
    """
    if isinstance(encoded, (str, bytes)) or not isinstance(encoded, Sequence) or len(encoded) == 0:
        raise TypeError(f"encoded must be a non-empty sequence of samples (sequences of byte tensors), got {encoded!r}")
    lengths = {len(frames) for frames in encoded}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"encoded samples must all hold the same number (>= 1) of frames, got {sorted(lengths)}")
    device = torch.device(device)
    flat = [data for frames in encoded for data in frames]
    decoded: list[torch.Tensor | None] = [None] * len(flat)
    jpegs = [i for i, data in enumerate(flat) if _is_jpeg(data)]
    if device.type == "cuda" and jpegs:
        try:
            images = decode_jpeg([flat[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
            for i, image in zip(jpegs, images, strict=True):
                decoded[i] = image
        except RuntimeError:  # a JPEG the device decoder refuses: decode them one by one with fallback
            decoded = [None] * len(flat)
    decoded = [image if image is not None else decode_rgb(flat[i], device) for i, image in enumerate(decoded)]
    frames = lengths.pop()
    clips = [torch.stack(decoded[i * frames : (i + 1) * frames]) for i in range(len(encoded))]
    return resized_crops(clips, boxes, size, interpolation)


# --- the data modules' side: worker samples and the batch hooks ----------------------------------------------------


class _WorkerSamples(Dataset):
    """Training samples for :class:`BatchAugment`, prepared in DataLoader workers.

    Item ``(index, epoch)``: inside :func:`~visionpe.training.sampling._seeded_rngs` of the sample's seed
    ``(seed, epoch, index)``, ``files(index)`` picks the sample's frame files and label (a clip's start is drawn
    there), then ``augment.sample_params`` draws its parameters from the image size in the file header. Decoded
    (``encoded=False``): the frames are decoded on the CPU and the crop box is cut out of each and resized to
    ``size`` here, giving ``(x uint8 (T, 3, S, S) or (3, S, S), label, params)``. Encoded (decoding on the device):
    ``(list of T file-byte tensors, label, params)``, params keeping ``crop`` for :func:`_prepare_batch`.
    """

    def __init__(
        self,
        files: Callable[[int], tuple[list[Path], int]],
        length: int,
        augment: BatchAugment,
        seed: int,
        interpolation: str,
        encoded: bool,
        clips: bool,
    ) -> None:
        self.files, self.length, self.augment, self.seed = files, length, augment, seed
        self.interpolation, self.encoded, self.clips = interpolation, encoded, clips

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[Any, int, dict[str, torch.Tensor]]:
        index, epoch = _unpack(item)
        with _one_thread(), _seeded_rngs(_sample_seed(self.seed, _TRAIN_STREAM, epoch, index)):
            paths, label = self.files(index)
            sizes = sorted({image_size(path) for path in paths})
            if len(sizes) != 1:
                raise ValueError(f"frames {paths[0].parent} differ in size {sizes}; expected one size")
            (height, width), mode = sizes[0], self.interpolation
            if mode == "random":  # timm's "random": bilinear or bicubic per sample
                mode = "bicubic" if torch.rand(()) < 0.5 else "bilinear"
            params = {key: value[0] for key, value in self.augment.sample_params(1, [height], [width]).items()}
            params["bicubic"] = torch.tensor(mode == "bicubic")
            data = [read_file(str(path)) for path in paths]
            if self.encoded:
                return data, label, params
            frames = torch.stack([decode_rgb(encoded) for encoded in data])
            x = resized_crops([frames], params.pop("crop")[None], self.augment.size, mode)[0]
            return (x if self.clips else x[0]), label, params


def _collate_samples(batch: list) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    """Stack decoded samples; keep encoded ones as a list of lists of byte tensors."""
    with _one_thread():
        rest = default_collate([item[1:] for item in batch])
        if isinstance(batch[0][0], torch.Tensor):
            return default_collate([item[0] for item in batch]), *rest
        return [item[0] for item in batch], *rest


class _HostParams:
    """Per-sample parameters kept on the CPU through Lightning's transfer (it moves tensors in dicts, not here), so
    that :class:`BatchAugment` reads which rows run which op without waiting for the device."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params


def _is_device_batch(batch: Any) -> bool:
    return isinstance(batch, (tuple, list)) and len(batch) == 3 and isinstance(batch[2], (dict, _HostParams))


def _prepare_batch(batch: Any, device: torch.device, size: int, clips: bool) -> Any:
    """Before the transfer: decode an encoded training batch on ``device`` and crop it to ``size``, and keep the
    parameters on the host (other batches pass through)."""
    if not _is_device_batch(batch):
        return batch
    x, labels, params = batch
    params = dict(params.params if isinstance(params, _HostParams) else params)
    if not isinstance(x, torch.Tensor):
        modes = ["bicubic" if flag else "bilinear" for flag in params.pop("bicubic").tolist()]
        x = decode_resized_crops(x, params.pop("crop"), size, device, modes)
        x = x if clips else x[:, 0]
    return x, labels, _HostParams(params)


class _GPUPipelineHooks:
    """What the image-folder and frame-clip data modules share of the GPU pipeline: the two switches, the choice
    of where training files are decoded, the worker dataset and the hook before the transfer. The data module
    sets ``gpu_pipeline``, ``decode_on_device`` (:meth:`_set_gpu_pipeline`), ``augment``, ``img_size`` and
    ``seed``; ``_clips`` says whether its batches are clips (B, T, C, H, W)."""

    _clips = False

    def _set_gpu_pipeline(self, gpu_pipeline: bool, decode_on_device: bool) -> None:
        for name, flag in (("gpu_pipeline", gpu_pipeline), ("decode_on_device", decode_on_device)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} ({flag!r})")
        self.gpu_pipeline, self.decode_on_device = gpu_pipeline, decode_on_device

    def _decodes_on_device(self) -> bool:
        """Whether training files are decoded on the trainer's device: a CUDA device and ``decode_on_device``."""
        trainer = getattr(self, "trainer", None)
        return bool(self.decode_on_device and trainer is not None and trainer.strategy.root_device.type == "cuda")

    def _worker_samples(
        self, files: Callable[[int], tuple[list[Path], int]], length: int, interpolation: str
    ) -> _WorkerSamples:
        """The training samples the workers prepare (decoded there, or encoded for :meth:`on_before_batch_transfer`)."""
        return _WorkerSamples(
            files,
            length,
            self.augment,
            self.seed,
            interpolation,
            encoded=self._decodes_on_device(),
            clips=self._clips,
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """GPU pipeline: decode an encoded training batch on the trainer's device (CUDA) and crop it to img_size;
        the augmentation parameters stay on the host (read there without a device sync)."""
        if not self.gpu_pipeline or self.trainer is None:
            return batch
        return _prepare_batch(batch, self.trainer.strategy.root_device, self.img_size, clips=self._clips)


def _augment_batch(batch: Any, augment: BatchAugment, size: int, clips: bool) -> Any:
    """``(x, y, params)`` -> ``(augment(x, params), y)`` on the batch's device; other batches pass through."""
    if not _is_device_batch(batch):
        return batch
    if not isinstance(batch[0], torch.Tensor):  # encoded and not decoded before the transfer: decode here
        batch = _prepare_batch(batch, batch[1].device, size, clips)
    x, labels, params = batch
    params = params.params if isinstance(params, _HostParams) else params
    return augment(x, {key: value for key, value in params.items() if key != "bicubic"}), labels
