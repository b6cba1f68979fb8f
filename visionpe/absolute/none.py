"""NoPE: no position encoding at all (the baseline every scheme is compared with)."""

from __future__ import annotations

import torch

from ..base import AbsolutePositionEncoding
from ..registry import register_scheme

__all__ = ["NoPosEmbed"]


@register_scheme("none")
class NoPosEmbed(AbsolutePositionEncoding):
    """Leaves the tokens as they are; works for 2D and 3D grids."""

    ndims = (2, 3)
    grid_ranks = (2, 3)

    def __init__(self, dim: int, num_heads: int, depth: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int) -> torch.Tensor:
        self.check_tokens(x, grid_size, num_prefix_tokens, self.dim)  # nothing to add, but the input must fit
        return x
