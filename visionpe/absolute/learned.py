"""Learned absolute position embedding: Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021.

E in R^{(P_e + H0 W0) x C}, trunc-normal(0.02) (timm's ViT; ``init_std`` sets another scale, e.g. big_vision's
1/sqrt(C)). With class rows (P_e = P, timm/ViT default) the prefix is
concatenated, then E added; with ``no_embed_class`` (DeiT III) E is added to patches only. At another grid
the patch rows are resampled (bicubic, antialias, fp32) and the prefix rows kept, as timm's
``resample_abs_pos_embed`` does; the old grid is always passed explicitly (it need not be square).
"""

from __future__ import annotations

import torch
from timm.layers import resample_abs_pos_embed, trunc_normal_
from torch import nn

from ..base import AbsolutePositionEncoding
from ..checks import check_choice, check_float, check_instance, check_int
from ..grid import is_symbolic_grid, validate_grid_size
from ..registry import register_scheme

__all__ = ["LearnedPosEmbed"]

_INTERPOLATIONS = ("bicubic", "bilinear", "nearest")

# Resampling runs eagerly under torch.compile (a graph break, only at grids other than the training grid): inductor
# fails on the antialiased bicubic backward (torch 2.14, a meta-kernel assertion); the table is small.
_resample = torch.compiler.disable(resample_abs_pos_embed)


@register_scheme("learned")
class LearnedPosEmbed(AbsolutePositionEncoding):
    """Learned table for a 2D training grid, resampled for other grids.

    Args:
        dim: model width.
        grid_size: training grid (H0, W0); the model passes its patch grid.
        num_prefix_tokens: cls + register tokens; with ``no_embed_class=False`` the table has a row for each.
        no_embed_class: DeiT-III form, no rows for prefix tokens.
        interpolation: resampling mode (``bicubic`` as timm, ``bilinear`` for the LookHere protocol).
        antialias: antialiased resampling when shrinking (timm's default).
        ar_preserving: keep the aspect ratio of the table's content: at another grid (H, W) the patch rows are
            resampled to the square max(H, W) x max(H, W) and its top-left H x W kept, as timm's NaFlex models with
            ``pos_embed_ar_preserving=True`` do (default False: resampled to H x W directly).
        align_corners: ``F.interpolate``'s ``align_corners`` for the bilinear and bicubic modes (default False; True
            as timm's NaFlex models with ``pos_embed_align_corners=True``).
        init_std: standard deviation of the table's truncated-normal initialisation (default 0.02, timm's ViT).
            big_vision's ViT draws it with std ``1 / sqrt(dim)``; in small models trained briefly the 0.02 table
            can stay too small next to the patch embedding for position to be learned at all.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        grid_size: tuple[int, int] = (14, 14),
        num_prefix_tokens: int = 1,
        no_embed_class: bool = False,
        interpolation: str = "bicubic",
        antialias: bool = True,
        ar_preserving: bool = False,
        align_corners: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.grid_size = validate_grid_size(grid_size, ndims=(2,))
        check_choice(interpolation, "interpolation", _INTERPOLATIONS)
        check_instance(ar_preserving, "ar_preserving", bool, expected="a bool")
        check_instance(align_corners, "align_corners", bool, expected="a bool")
        if align_corners and interpolation == "nearest":
            raise ValueError(
                "align_corners=True applies to the bilinear and bicubic modes, got interpolation='nearest'"
            )
        self.ar_preserving, self.align_corners = ar_preserving, align_corners
        check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
        self.num_prefix_tokens, self.no_embed_class = num_prefix_tokens, no_embed_class
        self.interpolation, self.antialias = interpolation, antialias
        self.num_embed_prefix = 0 if no_embed_class else num_prefix_tokens
        num_rows = self.num_embed_prefix + self.grid_size[0] * self.grid_size[1]
        check_float(init_std, "init_std", min=0.0, min_open=True)
        self.pos_embed = nn.Parameter(trunc_normal_(torch.zeros(1, num_rows, dim), std=init_std))

    def resampled(self, grid_size: tuple[int, int]) -> torch.Tensor:
        """The table for ``grid_size``: (1, P_e + H W, C); the same tensor when the grid is unchanged.

        A symbolic grid (export with dynamic height and width) is always resampled, inside the graph, so that the
        exported model runs at any grid (at the training grid the resampling returns the table up to rounding)."""
        grid_size = self.check_grid(grid_size)
        symbolic = is_symbolic_grid(grid_size)
        if not symbolic and grid_size == self.grid_size:
            return self.pos_embed
        if not self.ar_preserving:
            return self._resample(grid_size)
        if symbolic:
            raise ValueError(
                "ar_preserving=True crops a square table to each grid, which a graph with a dynamic grid cannot "
                f"express; export at a fixed image size, got grid_size={grid_size}"
            )
        height, width = grid_size
        side = max(height, width)
        table = self._resample((side, side))
        prefix, rows = table[:, : self.num_embed_prefix], table[:, self.num_embed_prefix :]
        rows = rows.reshape(1, side, side, -1)[:, :height, :width].reshape(1, height * width, -1)
        return torch.cat([prefix, rows], dim=1)

    def _resample(self, grid_size: tuple[int, int]) -> torch.Tensor:
        return _resample(
            self.pos_embed,
            new_size=list(grid_size),
            old_size=list(self.grid_size),
            num_prefix_tokens=self.num_embed_prefix,
            interpolation=self.interpolation,
            antialias=self.antialias,
            align_corners=True if self.align_corners else None,
        )

    def forward(self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int) -> torch.Tensor:
        grid_size = self.check_tokens(x, grid_size, num_prefix_tokens, self.pos_embed.shape[-1])
        if num_prefix_tokens != self.num_prefix_tokens:
            raise ValueError(
                f"learned table was built for {self.num_prefix_tokens} prefix tokens, got {num_prefix_tokens}"
            )
        pos_embed = self.resampled(grid_size)
        if self.no_embed_class and num_prefix_tokens:
            return torch.cat([x[:, :num_prefix_tokens], x[:, num_prefix_tokens:] + pos_embed], dim=1)
        return x + pos_embed

    def set_grid_size(self, grid_size: tuple[int, ...]) -> None:
        """Resample the stored table to a new nominal grid (``model.set_input_size``)."""
        grid_size = self.check_grid(grid_size)
        if grid_size != self.grid_size:
            with torch.no_grad():
                table = self.resampled(grid_size)
            self.pos_embed = nn.Parameter(table, requires_grad=self.pos_embed.requires_grad)
            self.grid_size = grid_size
