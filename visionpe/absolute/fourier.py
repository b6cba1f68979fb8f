"""Learnable Fourier Features: Li et al., "Learnable Fourier Features for Multi-Dimensional Spatial
Positional Encoding", NeurIPS 2021.

For positions X (N, G, M): F = |F|^(-1/2) [cos(X W_r^T) || sin(X W_r^T)], W_r in R^{|F|/2 x M} ~ N(0, gamma^-2),
trained; Y = GELU(F W_1 + B_1) W_2 + B_2 per group (output D / G each), concatenated over groups to (N, D)
and added to the patch tokens like an absolute PE (prefix tokens get none). Image patches use G = 1 group of
M = 2 coordinates (M = 3 for video), ``normalized`` coordinates by default, so a larger grid interpolates.
[reading] The paper's N(0, gamma^-2) is read as a variance: W_r = randn / gamma, std 1/gamma (10 for the default
gamma = 0.1). Widely copied implementations use other scales, most often ``normal_(std=gamma ** -2)`` (std 100 for
gamma = 0.1, 10x the frequencies); pass ``gamma`` to match one of them (gamma' = gamma^2 gives std gamma^-2).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..base import AbsolutePositionEncoding, check_coords
from ..checks import check_choice, check_int, check_positive, check_tensor
from ..grid import grid_coords
from ..registry import register_scheme

__all__ = ["LearnableFourierFeatures", "LearnableFourierPosEmbed"]

_COORD_MODES = ("normalized", "index", "centered")


class LearnableFourierFeatures(nn.Module):
    """The LFF encoder (Algorithm 1 of the paper): positions (..., G, M) -> encodings (..., D).

    Args:
        pos_dim: M, coordinates per group.
        out_dim: D, divisible by ``num_groups``.
        num_groups: G.
        fourier_dim: |F| (even).
        hidden_dim: |H|, the MLP hidden width.
        gamma: W_r ~ N(0, gamma^-2), read as the variance (std 1/gamma; see the module docstring for the std
            gamma^-2 of widely copied implementations); smaller gamma means higher frequencies.
    """

    def __init__(
        self,
        pos_dim: int,
        out_dim: int,
        num_groups: int = 1,
        fourier_dim: int = 128,
        hidden_dim: int = 256,
        gamma: float = 0.1,
    ) -> None:
        super().__init__()
        self.pos_dim = check_int(pos_dim, "pos_dim", min=1, expected="an int >= 1")
        self.num_groups = check_int(num_groups, "num_groups", min=1, expected="an int >= 1")
        self.fourier_dim = check_int(fourier_dim, "fourier_dim", min=2)
        self.hidden_dim = check_int(hidden_dim, "hidden_dim", min=1, expected="an int >= 1")
        if fourier_dim % 2:
            raise ValueError(f"fourier_dim |F| must be even, got {fourier_dim}")
        if check_int(out_dim, "out_dim", min=1, expected="an int >= 1") % num_groups:
            raise ValueError(f"out_dim must be divisible by num_groups, got out_dim={out_dim}, num_groups={num_groups}")
        self.gamma = check_positive(gamma, "gamma")
        self.freqs = nn.Parameter(torch.randn(fourier_dim // 2, pos_dim) / self.gamma)  # W_r
        self.mlp = nn.Sequential(
            nn.Linear(fourier_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, out_dim // num_groups)
        )

    def features(self, positions: torch.Tensor) -> torch.Tensor:
        """F before the MLP: positions (..., G, M) -> (..., G, |F|), computed in fp32."""
        check_tensor(positions, "positions", expected="a torch.Tensor of shape (..., G, M)")
        if positions.ndim < 2 or positions.shape[-2:] != (self.num_groups, self.pos_dim):
            raise ValueError(
                f"positions must have shape (..., G={self.num_groups}, M={self.pos_dim}), got {tuple(positions.shape)}"
            )
        check_tensor(positions, "positions", dtype="real")
        if not torch.compiler.is_compiling() and not torch.isfinite(positions).all():  # no data-dependent branch
            raise ValueError("positions must be finite, got NaN or inf in LearnableFourierFeatures positions")
        with torch.autocast(positions.device.type, enabled=False):
            angles = positions.float() @ self.freqs.float().t()
            return torch.cat([angles.cos(), angles.sin()], dim=-1) / math.sqrt(self.fourier_dim)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (..., G, M) -> (..., D), the per-group MLP outputs concatenated."""
        # fp32 features meet the MLP in its weights' dtype (a model cast to bf16 has no autocast to do it)
        return self.mlp(self.features(positions).to(self.mlp[0].weight.dtype)).flatten(-2)


@register_scheme("fourier")
class LearnableFourierPosEmbed(AbsolutePositionEncoding):
    """Learnable Fourier features + MLP as an absolute PE for 2D or 3D patch grids.

    Args:
        dim: model width D.
        ndim: 2 for images (coords (y, x)), 3 for video (t, y, x).
        num_groups: G. With G = 1 a patch is its centre; with G = 2 a patch is the two opposite corners of its
            cell (centre -/+ half a cell), the paper's box encoding applied to the patch extent.
        fourier_dim, hidden_dim, gamma: |F|, |H|, gamma (not published for ViT; the defaults suit
            ``normalized`` coordinates in (0, 1), where gamma = 0.1 gives frequencies of about 10 rad per image).
        coord_mode: ``normalized`` (default), ``index`` or ``centered``; with ``index`` a larger gamma fits better.
    """

    consumes_coords = True  # a training-time coord_augment draws the positions (patch centres or corners)

    grid_ranks = (2, 3)

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        ndim: int = 2,
        num_groups: int = 1,
        fourier_dim: int = 128,
        hidden_dim: int = 256,
        gamma: float = 0.1,
        coord_mode: str = "normalized",
    ) -> None:
        super().__init__()
        check_choice(ndim, "ndim", (2, 3), expected="2 (images) or 3 (video)")
        check_choice(coord_mode, "coord_mode", _COORD_MODES)
        check_choice(num_groups, "num_groups", (1, 2), expected="1 (patch centre) or 2 (patch corners) for a grid")
        self.ndims, self.coord_mode, self.dim = (ndim,), coord_mode, dim
        self.encoder = LearnableFourierFeatures(ndim, dim, num_groups, fourier_dim, hidden_dim, gamma)

    def no_weight_decay(self) -> set[str]:
        """The Fourier frequencies W_r (the MLP's weights are ordinary layers and keep weight decay)."""
        return {"encoder.freqs"}

    def positions(self, grid_size: tuple[int, ...], device=None) -> torch.Tensor:
        """(N, G, ndim) positions of the patches of ``grid_size`` in this scheme's coordinate mode."""
        grid_size = self.check_grid(grid_size)
        centres = grid_coords(grid_size, mode=self.coord_mode, device=device)
        if self.encoder.num_groups == 1:
            return centres[:, None, :]
        cell = torch.tensor(
            [1.0 / n if self.coord_mode == "normalized" else 1.0 for n in grid_size], device=centres.device
        )
        return torch.stack([centres - cell / 2, centres + cell / 2], dim=1)

    def encode(self, coords: torch.Tensor) -> torch.Tensor:
        """Encodings (N, D) of arbitrary patch-centre coordinates (N, ndim), e.g. kept tokens only."""
        coords = check_coords(coords, self.ndims, type(self).__name__)
        if self.encoder.num_groups != 1:
            raise ValueError(f"encode takes patch centres, which need num_groups=1, got {self.encoder.num_groups}")
        return self.encoder(coords[:, None, :])

    def forward(self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int) -> torch.Tensor:
        """``x`` (B, P + N, D) -> same shape, the encoding added to the N patch tokens."""
        grid_size = self.check_tokens(x, grid_size, num_prefix_tokens, self.dim)
        pe = self.encoder(self.forward_coords(grid_size, coords_fn=lambda grid: self.positions(grid, x.device)))
        return torch.cat([x[:, :num_prefix_tokens], x[:, num_prefix_tokens:] + pe.to(x.dtype)], dim=1)
