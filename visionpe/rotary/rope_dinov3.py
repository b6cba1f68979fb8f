"""DINOv3's RoPE: Siméoni et al., "DINOv3", arXiv 2508.10104, 2025 (facebookresearch/dinov3,
``dinov3/layers/rope_position_encoding.py``).

Axial RoPE on coordinates normalised to (-1, 1): c_a = 2 (i + 0.5) / n_a - 1 (``normalize_coords="separate"``;
``"max"`` and ``"min"`` divide i + 0.5 by max(H, W) or min(H, W) instead of n_a). Periods T_n = base^(2n / (d/2))
for n < d/4 (base 100: 1, 1.334, ..., 74.99 at d = 64), angle 2 pi c_a / T_n; the first d/4 rotary pairs read y, the
other d/4 read x. Per index step the frequency is 4 pi / (n_a T_n): a larger grid interpolates (more positions in
the same (-1, 1)), nothing is extrapolated. Prefix tokens (cls, registers) are not rotated.

Training-time coordinate augmentation, as released: shift (U(-s, s) per axis), jitter (a log-uniform factor in
[1/J, J] per axis) and rescale (one log-uniform factor in [1/S, S] for both axes), in that order, one draw per
forward; the released models use rescale 2 alone (``dinov3_vit7b16_pretrain.yaml`` and the hub backbones). They are
the ``dinov3`` kind of :class:`~visionpe.grid.CoordAugment`, which the scheme sets from its options.

Layout [visionpe]: DINOv3 pairs channel c with channel c + d/2 (rotate-half); visionpe pairs 2j with 2j + 1
(interleaved). Pair j here turns by the angle of DINOv3's pair j (y for j < d/4, x after), so with q and k channels
relabelled by :func:`half_to_interleaved` the rotated q and k are DINOv3's, relabelled, and the logits q . k are
equal. A model trained here is DINOv3's up to that fixed relabelling of the q/k projection rows; loading DINOv3's
weights permutes the rows of W_q and W_k (and their biases) of each head once.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..checks import check_choice, check_float, check_positive
from ..grid import CoordAugment, grid_coords
from ..registry import register_scheme
from .base import LinearRotary

__all__ = ["RopeDinoV3", "NORMALIZE_COORDS", "dinov3_periods", "half_to_interleaved"]

NORMALIZE_COORDS = ("separate", "max", "min")


def dinov3_periods(
    head_dim: int, base: float | None = 100.0, min_period: float | None = None, max_period: float | None = None
) -> torch.Tensor:
    """DINOv3's periods, fp32 ``(head_dim // 4,)``: T_n = base^(2n / (head_dim / 2)), or with ``min_period`` and
    ``max_period`` (and ``base=None``) geometric from min_period to max_period.

    Example:
        >>> dinov3_periods(16)
        tensor([ 1.0000,  3.1623, 10.0000, 31.6228])
    """
    if head_dim % 4:
        raise ValueError(f"head_dim must be divisible by 4, got {head_dim}")
    count = head_dim // 4
    both_periods = min_period is not None and max_period is not None
    if (base is None) != both_periods or (min_period is None) != (max_period is None):
        raise ValueError(
            "give either base or both min_period and max_period (with base=None), got "
            f"base={base!r}, min_period={min_period!r}, max_period={max_period!r}"
        )
    if base is not None:
        base = check_positive(base, "base")
        return base ** (2 * torch.arange(count, dtype=torch.float32) / (head_dim // 2))
    low, high = check_positive(min_period, "min_period"), check_positive(max_period, "max_period")
    if low > high:
        raise ValueError(f"min_period must be at most max_period, got min_period={low}, max_period={high}")
    # as the reference: (max / min)^t / (max / min) * max for t = linspace(0, 1)
    ratio = high / low
    return ratio ** torch.linspace(0, 1, count, dtype=torch.float32) / ratio * high


def half_to_interleaved(head_dim: int) -> torch.Tensor:
    """int64 ``(head_dim,)`` channel order that turns a DINOv3 (rotate-half) head into visionpe's interleaved pairs:
    ``x[..., half_to_interleaved(d)]`` puts DINOv3's channels c and c + d/2 at 2c and 2c + 1.

    Example:
        >>> half_to_interleaved(8)
        tensor([0, 4, 1, 5, 2, 6, 3, 7])
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()


@register_scheme("rope_dinov3")
class RopeDinoV3(LinearRotary):
    """DINOv3's axial RoPE with coordinates in (-1, 1) and its training-time coordinate augmentation.

    Args:
        dim, num_heads: model width and heads (head_dim divisible by 4).
        depth: blocks (every block shares the table).
        base: period base (100 as released); None with ``min_period`` and ``max_period``.
        min_period, max_period: DINOv3's alternative parametrisation of the periods (with ``base=None``).
        normalize_coords: ``"separate"`` (default, as released), ``"max"`` or ``"min"``: the denominator of
            (i + 0.5) per axis, n_a, max(H, W) or min(H, W).
        shift_coords, jitter_coords, rescale_coords: the training-time augmentation's bounds, s >= 0 and J, S >= 1,
            or None (off). Released: None, None, 2. They set :attr:`coord_augment` (``kind="dinov3"``), which
            :func:`~visionpe.base.set_coord_augment` or the model's ``coord_augment=`` may replace.
        grid_size: the training grid (the model passes it), by keyword, the one shared rotary option
            (:class:`~visionpe.rotary.base.RotaryOptions`) DINOv3 takes; kept as ``train_grid_size``, nothing
            depends on it.

    Extrapolation modes (PI, NTK, YaRN) do not apply: the normalised coordinates already interpolate.
    """

    supported_extrapolation = ("none",)
    grid_ranks = (2,)  # DINOv3's coordinate normalisation and augmentation are 2D
    shared_options = ("grid_size",)  # the coordinates are DINOv3's, and nothing is extrapolated

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float | None = 100.0,
        min_period: float | None = None,
        max_period: float | None = None,
        normalize_coords: str = "separate",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = 2.0,
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, 2, options=self.rotary_options(options, coord_mode="normalized"))
        self.coord_mode = "normalized_pm1"  # 2 (i + 0.5) / n - 1 (grid_coords' mode of that name for "separate")
        self.normalize_coords = check_choice(normalize_coords, "normalize_coords", NORMALIZE_COORDS)
        self.base, self.min_period, self.max_period = base, min_period, max_period
        self.register_buffer("periods", dinov3_periods(self.head_dim, base, min_period, max_period), persistent=False)
        bounds = {"shift": shift_coords, "jitter": jitter_coords, "rescale": rescale_coords}
        for name, value in bounds.items():  # named as the option in the messages
            if value is not None:
                check_float(value, f"{name}_coords", min=0 if name == "shift" else 1)
        if any(v is not None for v in bounds.values()):
            self.coord_augment = CoordAugment("dinov3", **bounds)

    def coords(self, grid_size: tuple[int, ...], device=None) -> torch.Tensor:
        """(N, 2) coordinates (y, x) in DINOv3's convention: 2 (i + 0.5) / D_a - 1 with D_a = n_a, max(H, W) or
        min(H, W) (``normalize_coords``), fp32, row-major."""
        grid_size = self.check_grid(grid_size)
        if self.normalize_coords == "separate":
            return grid_coords(grid_size, mode="normalized_pm1", device=device)
        denominator = max(grid_size) if self.normalize_coords == "max" else min(grid_size)
        return 2.0 * ((grid_coords(grid_size, device=device) + 0.5) / denominator) - 1.0

    def frequencies(self) -> torch.Tensor:
        """(1, 1, 2, head_dim // 2): 2 pi / T_n on pairs n < d/4 for y and on pairs d/4 + n for x."""
        rates = (2 * math.pi) / self.periods.float()
        zeros = torch.zeros_like(rates)
        return torch.stack((torch.cat((rates, zeros)), torch.cat((zeros, rates))))[None, None]

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # fp32 under model.to(bfloat16), as timm keeps its periods
        return {"periods": dinov3_periods(self.head_dim, self.base, self.min_period, self.max_period)}
