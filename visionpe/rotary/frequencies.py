"""Frequency helpers shared by the rotary schemes: base and axis-split checks, axial frequency matrices."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from ..checks import is_number

__all__ = ["check_base", "check_axis_pairs", "default_axis_pairs", "axial_frequencies"]


def check_base(base: float) -> float:
    """The frequency base of a rotary scheme as a float; ValueError unless it is a positive finite number.

    Example:
        >>> check_base(100)
        100.0
    """
    if not is_number(base) or not 0 < base < math.inf:
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


def default_axis_pairs(head_dim: int, ndim: int) -> tuple[int, ...]:
    """Rotary pairs per axis in pair order x, y[, t]: half each for x and y in 2D; in 3D t takes a quarter of the
    pairs and x and y share the rest.

    Example:
        >>> default_axis_pairs(64, 2), default_axis_pairs(64, 3)
        ((16, 16), (12, 12, 8))
    """
    pairs = head_dim // 2
    n_t = pairs // 4 if ndim == 3 else 0
    n_x = (pairs - n_t) // 2
    split = (n_x, pairs - n_t - n_x) + ((n_t,) if ndim == 3 else ())
    if min(split) < 1:
        axes, least = ("x, y, t", 8) if ndim == 3 else ("x, y", 4)
        raise ValueError(
            f"head_dim must give every axis of a {ndim}D grid ({axes}) a rotary pair by default: head_dim >= {least}, "
            f"got head_dim={head_dim} ({pairs} pairs); use more channels per head or pass axis_pairs"
        )
    return split


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
