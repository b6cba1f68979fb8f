"""Fixed 2D sin-cos embedding: Chen, Xie, He, "An Empirical Study of Training Self-Supervised Vision
Transformers" (MoCo v3), ICCV 2021; He et al., MAE, CVPR 2022.

omega_k = T^(-k / (C/4)), k < C/4, T = 10000; E(x, y) = [sin(x w) || cos(x w) || sin(y w) || cos(y w)] on
`index` coordinates (the first half encodes x, the column). Prefix rows are zero. On another grid the
table is rebuilt on integer positions (``resize='recompute'``) or resampled from the training grid
(``resize='interpolate'``, as the LookHere baseline did, bilinear).
"""

from __future__ import annotations

import torch
from timm.layers import resample_abs_pos_embed

from ..base import AbsolutePositionEncoding
from ..checks import check_choice, check_positive
from ..grid import grid_coords, is_symbolic_grid, validate_grid_size
from ..registry import register_scheme

__all__ = ["SinCosPosEmbed", "sincos_2d"]


def sincos_2d(coords: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """(N, dim) embedding of (N, 2) coordinates with columns (y, x).

    Example:
        >>> e = sincos_2d(torch.tensor([[0.0, 1.0]]), 4)  # (y, x) = (0, 1)
        >>> e.round(decimals=4)
        tensor([[0.8415, 0.5403, 0.0000, 1.0000]])
    """
    if dim % 4:
        raise ValueError(f"sincos needs dim divisible by 4, got dim={dim}")
    omega = temperature ** (-torch.arange(dim // 4, dtype=torch.float32, device=coords.device) / (dim // 4))
    y, x = coords.float().unbind(-1)
    xw, yw = x[:, None] * omega, y[:, None] * omega
    return torch.cat([xw.sin(), xw.cos(), yw.sin(), yw.cos()], dim=1)


@register_scheme("sincos")
class SinCosPosEmbed(AbsolutePositionEncoding):
    """Fixed 2D sin-cos table; nothing is learned.

    Args:
        dim: model width (divisible by 4).
        grid_size: training grid, used by ``resize='interpolate'``.
        resize: ``recompute`` (extrapolate on integer positions) or ``interpolate``.

    In training with a ``coord_augment`` (:class:`~visionpe.grid.CoordAugment`) the table is computed on the drawn
    coordinates, whatever ``resize``.
    """

    consumes_coords = True  # index coordinates; a training-time coord_augment draws them

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        grid_size: tuple[int, int] = (14, 14),
        temperature: float = 10000.0,
        resize: str = "recompute",
    ) -> None:
        super().__init__()
        if dim % 4:
            raise ValueError(f"sincos needs dim divisible by 4, got dim={dim}")
        check_choice(resize, "resize", ("recompute", "interpolate"), expected="'recompute' or 'interpolate'")
        check_positive(temperature, "temperature")
        self.dim, self.temperature, self.resize = dim, temperature, resize
        self.grid_size = validate_grid_size(grid_size, ndims=(2,))

    def table(self, grid_size: tuple[int, int], device=None) -> torch.Tensor:
        """(H W, dim) table for ``grid_size``; a symbolic grid (export with dynamic height and width) resamples
        inside the graph with ``resize='interpolate'``, even at the training grid."""
        grid_size = self.check_grid(grid_size)
        if self.resize == "recompute" or (not is_symbolic_grid(grid_size) and grid_size == self.grid_size):
            return sincos_2d(grid_coords(grid_size, device=device), self.dim, self.temperature)
        base = sincos_2d(grid_coords(self.grid_size, device=device), self.dim, self.temperature)
        return resample_abs_pos_embed(
            base[None],
            new_size=list(grid_size),
            old_size=list(self.grid_size),
            num_prefix_tokens=0,
            interpolation="bilinear",
            antialias=False,
        )[0]

    def forward(self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int) -> torch.Tensor:
        grid_size = self.check_tokens(x, grid_size, num_prefix_tokens, self.dim)
        if self.training and self.coord_augment is not None:  # the table of drawn coordinates
            pe = sincos_2d(self.forward_coords(grid_size, x.device), self.dim, self.temperature).to(x.dtype)
        else:
            pe = self.table(grid_size, x.device).to(x.dtype)
        return torch.cat([x[:, :num_prefix_tokens], x[:, num_prefix_tokens:] + pe], dim=1)
