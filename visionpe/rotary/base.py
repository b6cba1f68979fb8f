"""Base class for rotary schemes whose angle is linear in position: phi_j(p) = sum_a p_a * F[a, j].

Extrapolation-time scaling (SCHEMES.md A13: PI, NTK-aware, YaRN) acts on F per axis, see :mod:`.scaling`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from ..base import RotaryPositionEncoding
from .functional import apply_rotary, rotary_angles, rotary_tables
from .scaling import Extrapolation, scale_frequencies, yarn_attention_factor

__all__ = ["LinearRotary"]


class LinearRotary(RotaryPositionEncoding, Extrapolation):
    """Subclasses implement :meth:`frequencies`, returning (depth | 1, num_heads | 1, ndim, head_dim // 2).

    ``prepare`` builds cos/sin for every layer at once (one fp32 pass per forward); ``apply`` picks a layer.
    With ``extrapolation`` set, ``prepare`` rescales the frequencies for the current ``grid_size`` relative to
    the training grid (``grid_size`` at construction); the default ``"none"`` leaves them untouched.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int,
        ndim: int,
        coord_mode: str = "index",
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
    ) -> None:
        super().__init__()
        head_dim = dim // num_heads
        if ndim not in (2, 3):
            raise ValueError(f"ndim must be 2 or 3, got {ndim!r}")
        if head_dim % 4:
            raise ValueError(f"head_dim must be divisible by 4 for rotary schemes, got head_dim={head_dim}")
        self.dim, self.num_heads, self.depth, self.ndim = dim, num_heads, depth, ndim
        self.head_dim, self.coord_mode = head_dim, coord_mode
        if grid_size is not None and len(grid_size) != ndim:
            raise ValueError(f"grid_size must have ndim={ndim} entries, got {tuple(grid_size)}")
        self.init_extrapolation(extrapolation, grid_size, yarn_alpha, yarn_beta)

    @property
    def ndims(self) -> tuple[int, ...]:  # the instance supports exactly the rank it was built for
        return (self.ndim,)

    @abstractmethod
    def frequencies(self) -> torch.Tensor:
        """(depth | 1, num_heads | 1, ndim, head_dim // 2) frequencies, rows in coordinate order."""

    def scaled_frequencies(self, grid_size: Sequence[int] | None = None) -> tuple[torch.Tensor, float]:
        """Frequencies for ``grid_size`` under the extrapolation mode, and the cos/sin multiplier (YaRN)."""
        freqs = self.frequencies()
        factors = self.scale_factors(grid_size)
        if factors is None:
            return freqs, 1.0
        freqs = scale_frequencies(
            freqs, factors, self.extrapolation, self.train_grid_size, self.yarn_alpha, self.yarn_beta
        )
        return freqs, yarn_attention_factor(factors) if self.extrapolation == "yarn" else 1.0

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs, mscale = self.scaled_frequencies(grid_size)
        cos, sin = rotary_tables(rotary_angles(coords, freqs), num_prefix_tokens)
        if mscale != 1.0:
            # YaRN's temperature: every row (prefix included) so all logits scale alike
            cos, sin = cos * mscale, sin * mscale
        return cos, sin

    def apply(self, qk: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], layer: int) -> torch.Tensor:
        cos, sin = state
        if cos.shape[0] > 1:
            cos, sin = cos[layer], sin[layer]
        else:
            cos, sin = cos[0], sin[0]
        return apply_rotary(qk, cos, sin)
