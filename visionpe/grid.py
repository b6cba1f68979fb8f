"""Token coordinates for 2D (h, w) and 3D (t, h, w) patch grids: the one place coordinates are built.

Tokens are stored row-major (k = y * W + x for 2D, k = (t * H + y) * W + x for 3D). The coordinate
columns follow the grid axes: ``(y, x)`` for 2D and ``(t, y, x)`` for 3D. Prefix tokens (cls and
registers) come before the patch tokens and have no grid coordinate; see :func:`prefix_mask`.

Coordinate modes (``coord_mode`` of every scheme):

- ``index``: integer positions, x in {0..W-1};
- ``centered``: i - (n - 1) / 2;
- ``normalized``: (i + 0.5) / n, in (0, 1);
- ``ref_scaled``: i * n_ref / n, position interpolation to a reference grid.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from .checks import check_choice, check_int, check_positive

__all__ = ["COORD_MODES", "grid_coords", "prefix_mask", "validate_count", "validate_grid_size", "validate_positive"]

COORD_MODES = ("index", "centered", "normalized", "ref_scaled")


def validate_count(value: int, name: str = "num_prefix_tokens") -> int:
    """``value`` if it is a non-negative int (not a bool): :func:`~visionpe.checks.check_int` with ``min=0``.

    A negative value raises ValueError; another type raises :class:`~visionpe.checks.ArgumentTypeError`, a
    TypeError that is also a ValueError.

    Example:
        >>> validate_count(1)
        1
    """
    return check_int(value, name, min=0)


def validate_positive(value: float, name: str) -> float:
    """``value`` as a float if it is a positive finite number (:func:`~visionpe.checks.check_positive`): TypeError
    naming ``name`` for a non-number (bool included), ValueError for zero, negative, inf or NaN.

    Example:
        >>> validate_positive(2, "ratio")
        2.0
    """
    return check_positive(value, name)


def validate_grid_size(grid_size: Sequence[int], name: str = "grid_size", ndims: Sequence[int] = (2, 3)) -> tuple:
    """Check that ``grid_size`` is a tuple of positive ints with an allowed length; return it as a tuple.

    Integer tensors, NumPy arrays and NumPy integers are accepted (as Python ints); floats are not, even 2.0.
    """
    if isinstance(grid_size, torch.Tensor) or type(grid_size).__module__ == "numpy":
        grid_size = grid_size.tolist()
    if not isinstance(grid_size, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(grid_size).__name__}")
    if len(grid_size) not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} entries, got {len(grid_size)}: {grid_size}")
    out = []
    for i, g in enumerate(grid_size):
        value = g
        if not isinstance(g, int):  # Python ints (and sizes traced by torch.compile) pass as they are
            try:
                # operator.index takes exactly the integer types (NumPy ints, 0-d integer tensors), not 2.0
                value = operator.index(g)
            except TypeError:
                pass
        out.append(check_int(value, f"{name}[{i}]", min=1, expected="positive", type_expected="an int"))
    return tuple(out)


def _axis(n: int, mode: str, n_ref: int | None, device) -> torch.Tensor:
    i = torch.arange(n, device=device, dtype=torch.float32)
    if mode == "index":
        return i
    if mode == "centered":
        return i - (n - 1) / 2
    if mode == "normalized":
        return (i + 0.5) / n
    return i * (n_ref / n)


def grid_coords(
    grid_size: Sequence[int],
    mode: str = "index",
    ref_grid_size: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Coordinates of the patch tokens of a grid, row-major, in fp32.

    Args:
        grid_size: ``(H, W)`` or ``(T, H, W)``.
        mode: one of ``index``, ``centered``, ``normalized``, ``ref_scaled``.
        ref_grid_size: the training grid, required by ``ref_scaled`` (same length as ``grid_size``).
        device: output device.

    Returns:
        ``(N, ndim)`` float32 tensor, columns ``(y, x)`` or ``(t, y, x)``, ``N = prod(grid_size)``.

    Example:
        >>> grid_coords((2, 3))
        tensor([[0., 0.],
                [0., 1.],
                [0., 2.],
                [1., 0.],
                [1., 1.],
                [1., 2.]])
        >>> grid_coords((1, 4), mode="centered")[:, 1]
        tensor([-1.5000, -0.5000,  0.5000,  1.5000])
    """
    grid_size = validate_grid_size(grid_size)
    check_choice(mode, "mode", COORD_MODES)
    if mode == "ref_scaled":
        if ref_grid_size is None:
            raise ValueError("mode='ref_scaled' needs ref_grid_size (the training grid), got None")
        ref_grid_size = validate_grid_size(ref_grid_size, "ref_grid_size", ndims=(len(grid_size),))
    else:
        ref_grid_size = (None,) * len(grid_size)
    axes = [_axis(n, mode, r, device) for n, r in zip(grid_size, ref_grid_size, strict=True)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(grid_size))


def prefix_mask(num_prefix_tokens: int, num_patches: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(num_prefix_tokens + num_patches,)`` mask, True on prefix (cls/register) tokens.

    Example:
        >>> prefix_mask(1, 3)
        tensor([ True, False, False, False])
    """
    validate_count(num_prefix_tokens, "num_prefix_tokens")
    validate_count(num_patches, "num_patches")
    mask = torch.zeros(num_prefix_tokens + num_patches, dtype=torch.bool, device=device)
    mask[:num_prefix_tokens] = True
    return mask
