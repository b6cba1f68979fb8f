"""RoPE-Axial: Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024 (naver-ai/rope-vit).

2D: half of the rotary pairs read x, half read y, with theta_n = base^(-4n/d), n < d/4 (base 100 for ViT):
phi_j = x * theta_j for j < d/4 and phi_j = y * theta_{j - d/4} otherwise. Interleaved pairs, `index` coords.
3D (video) [visionpe]: pairs are split (x, y, t) with counts (n_x, n_y, n_t), theta_{a,n} = base^(-n / n_a);
the default gives t a quarter of the pairs, e.g. (12, 12, 8) for head_dim 64.
Nothing is learned; on a larger grid the table is rebuilt on integer positions (extrapolation).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from ..registry import register_scheme
from .base import LinearRotary

__all__ = ["RopeAxial", "axial_frequencies", "check_axis_pairs", "check_base"]


def check_base(base: float) -> float:
    """The frequency base of a rotary scheme as a float; ValueError unless it is a positive finite number."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not 0 < base < math.inf:
        raise ValueError(f"base must be positive and finite, got {base!r}")
    return float(base)


def check_axis_pairs(axis_pairs: Sequence[int]) -> tuple[int, ...]:
    """``axis_pairs`` as a tuple of positive ints: TypeError naming ``axis_pairs[i]`` for a non-int entry (bool and
    2.0 included), ValueError for one <= 0.

    Example:
        >>> check_axis_pairs([12, 12, 8])
        (12, 12, 8)
    """
    if isinstance(axis_pairs, torch.Tensor) or type(axis_pairs).__module__ == "numpy":
        axis_pairs = axis_pairs.tolist()
    if not isinstance(axis_pairs, (tuple, list)):
        raise TypeError(f"axis_pairs must be a tuple of ints, got {type(axis_pairs).__name__} ({axis_pairs!r})")
    out = []
    for i, n in enumerate(axis_pairs):
        try:  # Python and NumPy ints, not 2.0
            value = None if isinstance(n, bool) else operator.index(n)
        except TypeError:
            value = None
        if value is None:
            raise TypeError(f"axis_pairs[{i}] must be a positive int, got {type(n).__name__} ({n!r})")
        if value <= 0:
            raise ValueError(f"axis_pairs[{i}] must be a positive int, got {value}")
        out.append(value)
    return tuple(out)


def axial_frequencies(head_dim: int, base: float, axis_pairs: Sequence[int]) -> torch.Tensor:
    """(ndim, head_dim // 2) frequency matrix; rows in coordinate order ((y, x) or (t, y, x)).

    ``axis_pairs`` counts pairs per axis in pair order x, y[, t]: pairs [0, n_x) read x, the next n_y read y.

    Example:
        >>> axial_frequencies(8, 100.0, (2, 2))
        tensor([[0.0000, 0.0000, 1.0000, 0.1000],
                [1.0000, 0.1000, 0.0000, 0.0000]])
    """
    axis_pairs = check_axis_pairs(axis_pairs)
    if sum(axis_pairs) != head_dim // 2:
        raise ValueError(f"axis_pairs must sum to head_dim // 2 = {head_dim // 2}, got {tuple(axis_pairs)}")
    freqs = torch.zeros(len(axis_pairs), head_dim // 2, dtype=torch.float64)
    start = 0
    for axis, n in enumerate(axis_pairs):
        freqs[axis, start : start + n] = base ** (-torch.arange(n, dtype=torch.float64) / n)
        start += n
    # pair order is x, y, t; coordinate columns are (y, x) or (t, y, x): reverse the rows
    return freqs.flip(0).float()


@register_scheme("rope_axial")
class RopeAxial(LinearRotary):
    """Axial 2D/3D RoPE.

    Args:
        dim: model width; num_heads: heads; depth: blocks (unused, every block shares the table).
        base: frequency base (rope-vit uses 100 for ViT, Qwen 10000).
        ndim: 2 for images, 3 for video (t, y, x).
        axis_pairs: pairs per axis in order x, y[, t]; default (d/4, d/4) in 2D, d/8 pairs for t in 3D.
        coord_mode: grid convention (``index`` = the paper's integer positions).
        grid_size: training grid (the model passes it); the reference of ``extrapolation``.
        extrapolation: ``none`` (default), ``pi``, ``ntk`` or ``yarn`` scaling at a larger grid (SCHEMES.md A13).
        yarn_alpha, yarn_beta: YaRN ramp bounds.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 100.0,
        ndim: int = 2,
        axis_pairs: Sequence[int] | None = None,
        coord_mode: str = "index",
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta)
        pairs = self.head_dim // 2
        if axis_pairs is None:
            n_t = pairs // 4 if ndim == 3 else 0
            n_x = (pairs - n_t) // 2
            axis_pairs = (n_x, pairs - n_t - n_x) + ((n_t,) if ndim == 3 else ())
        axis_pairs = check_axis_pairs(axis_pairs)
        if len(axis_pairs) != ndim:
            raise ValueError(f"axis_pairs must have {ndim} entries for ndim={ndim}, got {tuple(axis_pairs)}")
        self.base, self.axis_pairs = check_base(base), tuple(axis_pairs)
        self.register_buffer("freqs", axial_frequencies(self.head_dim, base, axis_pairs), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return self.freqs[None, None]

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        # model.to(bfloat16) casts every floating buffer; fixed frequencies are rebuilt in fp32 (angles grow with
        # position, so bf16 frequencies would cost ~0.1 rad at x = 63), as timm does for its rotary bands
        if torch.finfo(self.freqs.dtype).bits < 32:
            freqs = axial_frequencies(self.head_dim, self.base, self.axis_pairs).to(self.freqs.device)
            self.register_buffer("freqs", freqs, persistent=False)
        return module
