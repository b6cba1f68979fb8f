"""LOOPE: Chowdhury, Rahman, Taki, "LOOPE: Learnable Optimal Patch Order in Positional Embeddings for Vision
Transformers", arXiv 2504.14386, 2025.

Each patch gets one scalar position X = X_G + X_C: X_G its index along a generalized Hilbert ("Gilbert") curve
through the H x W grid, X_C a learned context offset per patch. The embedding is 1D sin-cos of that scalar,
E(X) = [sin(X w) || cos(X w)] with the fixed spectrum w_k = 10000^(-2k/C), k < C/2, added to the patch tokens
(prefix tokens get a zero row).

The library's reading where the paper summary leaves it open: X_C in R^(H0 W0) (one scalar per patch of the training
grid), zero at init and excluded from weight decay; on another grid X_G is recomputed (the curve changes as a
whole) and X_C is resampled bicubically as the learned table is, so the context only interpolates. The paper's
Three-Cell Experiment (a probe of how much relative and absolute position a PE retains) is not provided: its protocol
and metric formulas were not available.

The curve: Jakub Cerveny's generalized Hilbert curve for rectangles of any size ("gilbert", 2019), written here from
its description (:func:`gilbert_curve`).
"""

from __future__ import annotations

import functools
import math

import torch
from timm.layers import resample_abs_pos_embed
from torch import nn

from ..base import AbsolutePositionEncoding
from ..checks import check_bool, check_choice, check_positive
from ..grid import validate_grid_size
from ..registry import register_scheme

__all__ = ["LOOPE", "gilbert_curve", "gilbert_index", "sincos_1d"]

_INTERPOLATIONS = ("bicubic", "bilinear", "nearest")

# resampling runs eagerly under torch.compile, as for the learned table (inductor fails on the antialiased bicubic
# backward, torch 2.14); X_C is small
_resample = torch.compiler.disable(resample_abs_pos_embed)


def _sign(v: int) -> int:
    return (v > 0) - (v < 0)


@functools.lru_cache(maxsize=64)
def _curve(height: int, width: int) -> tuple[tuple[int, int], ...]:
    # A rectangle is given by its corner (x, y), its major side (ax, ay) and its minor side (bx, by), each along
    # one axis and possibly negative; the curve enters at the corner.
    # A one-cell-thick rectangle is walked straight. Otherwise, a rectangle much longer than wide (2w > 3h) is cut
    # across its major side into two halves walked in turn; any other one into three: a first part along the minor
    # side (its major and minor sides swapped), the remaining full-length strip, and a last part walked back to the
    # far corner. Halves are rounded so that sub-rectangles longer than 2 have even lengths, which keeps every step
    # between neighbours (a diagonal step is left only where parity forces one).
    cells: list[tuple[int, int]] = []
    pending = [(0, 0, width, 0, 0, height) if width >= height else (0, 0, 0, height, width, 0)]
    while pending:
        x, y, ax, ay, bx, by = pending.pop()
        w, h = abs(ax + ay), abs(bx + by)
        dax, day, dbx, dby = _sign(ax), _sign(ay), _sign(bx), _sign(by)
        if h == 1 or w == 1:
            sx, sy, steps = (dax, day, w) if h == 1 else (dbx, dby, h)
            cells.extend((y + i * sy, x + i * sx) for i in range(steps))
            continue
        ax2, ay2, bx2, by2 = ax // 2, ay // 2, bx // 2, by // 2
        if 2 * w > 3 * h:
            if abs(ax2 + ay2) % 2 and w > 2:
                ax2, ay2 = ax2 + dax, ay2 + day
            parts = [(x, y, ax2, ay2, bx, by), (x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by)]
        else:
            if abs(bx2 + by2) % 2 and h > 2:
                bx2, by2 = bx2 + dbx, by2 + dby
            parts = [
                (x, y, bx2, by2, ax2, ay2),
                (x + bx2, y + by2, ax, ay, bx - bx2, by - by2),
                (x + (ax - dax) + (bx2 - dbx), y + (ay - day) + (by2 - dby), -bx2, -by2, -(ax - ax2), -(ay - ay2)),
            ]
        pending.extend(reversed(parts))  # the first part is walked first
    return tuple(cells)


def gilbert_curve(grid_size: tuple[int, int]) -> list[tuple[int, int]]:
    """The cells (y, x) of an H x W grid in the order of the generalized Hilbert curve.

    The curve starts at (0, 0) and advances along the longer side (x when W >= H). Every cell is visited once, and
    consecutive cells are neighbours (Chebyshev distance 1); they share a side except for at most one diagonal
    step, which parity forces when the longer side is odd and the shorter even.

    Example:
        >>> gilbert_curve((2, 3))
        [(0, 0), (1, 0), (1, 1), (1, 2), (0, 2), (0, 1)]
    """
    height, width = validate_grid_size(grid_size, ndims=(2,))
    return list(_curve(height, width))


def gilbert_index(grid_size: tuple[int, int], device=None) -> torch.Tensor:
    """X_G: (H W,) int64 position along :func:`gilbert_curve` of each patch, patches in row-major order.

    Example:
        >>> gilbert_index((2, 3))  # row 0: (0,0) (0,1) (0,2); row 1: (1,0) (1,1) (1,2)
        tensor([0, 5, 4, 1, 2, 3])
    """
    height, width = validate_grid_size(grid_size, ndims=(2,))
    rank = [0] * (height * width)
    for step, (y, x) in enumerate(_curve(height, width)):
        rank[y * width + x] = step
    return torch.tensor(rank, dtype=torch.int64, device=device)


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """(N, dim) = [sin(X w) || cos(X w)] of scalar positions X (N,), w_k = temperature^(-2k/dim), fp32.

    Example:
        >>> sincos_1d(torch.tensor([1.0]), 4).round(decimals=4)
        tensor([[0.8415, 0.0100, 0.5403, 1.0000]])
    """
    if not isinstance(positions, torch.Tensor) or positions.ndim != 1:
        raise ValueError(f"positions must be a (N,) tensor, got {getattr(positions, 'shape', type(positions))}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim must be an even int >= 2, got {dim!r}")
    with torch.autocast(positions.device.type, enabled=False):
        omega = temperature ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
        angles = positions.float()[:, None] * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)


@register_scheme("loope")
class LOOPE(AbsolutePositionEncoding):
    """Sin-cos of each patch's Gilbert-curve index plus a learned context offset (see the module docstring).

    Args:
        dim: model width (even).
        num_heads, depth: unused (the registry's common signature).
        grid_size: training grid (H0, W0); the model passes its patch grid. X_C has H0 W0 entries.
        temperature: base of the fixed spectrum (10000).
        interpolation, antialias: how X_C is resampled on another grid (bicubic with antialias, as the learned
            table).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        grid_size: tuple[int, int] = (14, 14),
        temperature: float = 10000.0,
        interpolation: str = "bicubic",
        antialias: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
            raise ValueError(f"loope needs an even dim >= 2 (sin and cos halves), got dim={dim!r}")
        self.dim = dim
        self.grid_size = validate_grid_size(grid_size, ndims=(2,))
        self.temperature = check_positive(temperature, "temperature")
        self.interpolation = check_choice(interpolation, "interpolation", _INTERPOLATIONS)
        self.antialias = check_bool(antialias, "antialias")
        # X_C, one scalar per training patch, stored (1, H0 W0, 1) like a one-channel table for resampling
        self.context = nn.Parameter(torch.zeros(1, self.grid_size[0] * self.grid_size[1], 1))

    def context_offsets(self, grid_size: tuple[int, int]) -> torch.Tensor:
        """X_C for ``grid_size``: (H W,), resampled from the training grid when it differs."""
        grid_size = self.check_grid(grid_size)
        context = self.context
        if grid_size != self.grid_size:
            context = _resample(
                context,
                new_size=list(grid_size),
                old_size=list(self.grid_size),
                num_prefix_tokens=0,
                interpolation=self.interpolation,
                antialias=self.antialias,
            )
        return context[0, :, 0]

    def positions(self, grid_size: tuple[int, int], device=None) -> torch.Tensor:
        """X = X_G + X_C: (H W,) fp32 scalar position of each patch (row-major)."""
        grid_size = self.check_grid(grid_size)
        offsets = self.context_offsets(grid_size).float()
        return gilbert_index(grid_size, device=offsets.device if device is None else device) + offsets

    def table(self, grid_size: tuple[int, int], device=None) -> torch.Tensor:
        """(H W, dim) embedding E(X) of every patch."""
        return sincos_1d(self.positions(grid_size, device), self.dim, self.temperature)

    def forward(self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int) -> torch.Tensor:
        grid_size = self.check_tokens(x, grid_size, num_prefix_tokens, self.dim)
        pe = self.table(grid_size, x.device).to(x.dtype)
        return torch.cat([x[:, :num_prefix_tokens], x[:, num_prefix_tokens:] + pe], dim=1)

    def resample_table(self, name: str, value: torch.Tensor) -> torch.Tensor | None:
        """X_C from a checkpoint of another (square) training grid, resampled to this one as :meth:`context_offsets`
        resamples; None when ``name`` is not ``context`` or ``value`` is not a (1, n^2, 1) X_C. The checkpoint
        loader (:func:`~visionpe.load_timm_state_dict`, timm's ``pretrained``) calls it."""
        if name != "context" or not isinstance(value, torch.Tensor) or value.ndim != 3 or value.shape[::2] != (1, 1):
            return None
        side = math.isqrt(value.shape[1])
        if side * side != value.shape[1]:
            return None
        with torch.no_grad():
            out = resample_abs_pos_embed(
                value.float(),
                new_size=list(self.grid_size),
                old_size=[side, side],
                num_prefix_tokens=0,
                interpolation=self.interpolation,
                antialias=self.antialias,
            )
        return out.to(value.dtype)

    def no_weight_decay(self) -> set[str]:
        """X_C (decay would pull the positions back to the curve's)."""
        return {"context"}

    def set_grid_size(self, grid_size: tuple[int, ...]) -> None:
        """Resample X_C to a new nominal grid (``model.set_input_size``)."""
        grid_size = self.check_grid(grid_size)
        if grid_size != self.grid_size:
            with torch.no_grad():
                context = self.context_offsets(grid_size)[None, :, None]
            self.context = nn.Parameter(context.contiguous(), requires_grad=self.context.requires_grad)
            self.grid_size = grid_size
