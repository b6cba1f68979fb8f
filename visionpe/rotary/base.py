"""Base class for rotary schemes whose angle is linear in position: phi_j(p) = sum_a p_a * F[a, j]."""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..base import RotaryPositionEncoding
from .functional import apply_rotary, rotary_angles, rotary_tables

__all__ = ["LinearRotary"]


class LinearRotary(RotaryPositionEncoding):
    """Subclasses implement :meth:`frequencies`, returning (depth | 1, num_heads | 1, ndim, head_dim // 2).

    ``prepare`` builds cos/sin for every layer at once (one fp32 pass per forward); ``apply`` picks a layer.
    """

    def __init__(self, dim: int, num_heads: int, depth: int, ndim: int) -> None:
        super().__init__()
        head_dim = dim // num_heads
        if ndim not in (2, 3):
            raise ValueError(f"ndim must be 2 or 3, got {ndim!r}")
        if head_dim % 4:
            raise ValueError(f"head_dim must be divisible by 4 for rotary schemes, got head_dim={head_dim}")
        self.dim, self.num_heads, self.depth, self.ndim = dim, num_heads, depth, ndim
        self.head_dim = head_dim

    @property
    def ndims(self) -> tuple[int, ...]:  # the instance supports exactly the rank it was built for
        return (self.ndim,)

    @abstractmethod
    def frequencies(self) -> torch.Tensor:
        """(depth | 1, num_heads | 1, ndim, head_dim // 2) frequencies, rows in coordinate order."""

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(rotary_angles(coords, self.frequencies()), num_prefix_tokens)

    def apply(self, qk: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], layer: int) -> torch.Tensor:
        cos, sin = state
        if cos.shape[0] > 1:
            cos, sin = cos[layer], sin[layer]
        else:
            cos, sin = cos[0], sin[0]
        return apply_rotary(qk, cos, sin)
