"""Factorized learned position embedding: Dehghani et al., "Patch n' Pack: NaViT, a Vision Transformer for any Aspect
Ratio and Resolution", NeurIPS 2023.

Two learned tables, one per axis: E_y (H0, C) and E_x (W0, C), normal(0.02) as timm's NaFlex models initialise them
(``init_std`` sets another scale);
patch (i, j) gets E_y[i] + E_x[j], added to the patch tokens only (prefix tokens get nothing). At another grid (H, W)
each table is resampled on its own, linearly (``align_corners=False``, no antialias), to H rows and W columns; with
``ar_preserving`` both to max(H, W) and the first H and W entries kept, as timm's ``NaFlexEmbeds`` with
``pos_embed="factorized"`` does. Parameters: (H0 + W0) C instead of H0 W0 C.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..base import AbsolutePositionEncoding
from ..checks import check_float, check_instance
from ..grid import is_symbolic_grid, validate_grid_size
from ..registry import register_scheme

__all__ = ["FactorizedPosEmbed"]


def _resample_axis(table: torch.Tensor, length, symbolic: bool) -> torch.Tensor:
    """(1, L0, C) -> (1, length, C), linear; the same tensor at the same length (unless the grid is symbolic)."""
    if not symbolic and length == table.shape[1]:
        return table
    out = F.interpolate(table.permute(0, 2, 1).float(), size=length, mode="linear", align_corners=False)
    return out.permute(0, 2, 1).to(table.dtype)


@register_scheme("learned_factorized")
class FactorizedPosEmbed(AbsolutePositionEncoding):
    """One learned table per axis, summed per patch (NaViT's factorized embedding).

    Args:
        dim: model width.
        grid_size: training grid (H0, W0); the model passes its patch grid.
        num_prefix_tokens: cls + register tokens (the model passes it); they get no embedding.
        ar_preserving: resample both axes to max(H, W) and keep the first H and W entries (timm's
            ``pos_embed_ar_preserving=True``); default False: each axis to its own length.
        init_std: standard deviation of both tables' normal initialisation (default 0.02, timm's NaFlex models;
            big_vision draws position tables with std ``1 / sqrt(dim)``).
    """

    no_embed_class = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        grid_size: tuple[int, int] = (14, 14),
        num_prefix_tokens: int = 1,
        ar_preserving: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.grid_size = validate_grid_size(grid_size, ndims=(2,))
        check_instance(ar_preserving, "ar_preserving", bool, expected="a bool")
        self.ar_preserving = ar_preserving
        self.num_prefix_tokens = num_prefix_tokens
        height, width = self.grid_size
        check_float(init_std, "init_std", min=0.0, min_open=True)
        self.pos_embed_y = nn.Parameter(torch.randn(1, height, dim) * init_std)
        self.pos_embed_x = nn.Parameter(torch.randn(1, width, dim) * init_std)

    def no_weight_decay(self) -> set[str]:
        """Both tables, as timm keeps its position tables out of weight decay."""
        return {"pos_embed_y", "pos_embed_x"}

    def table(self, grid_size: tuple[int, int]) -> torch.Tensor:
        """The patch embeddings for ``grid_size``: (1, H W, C), row-major."""
        grid_size = self.check_grid(grid_size)
        symbolic = is_symbolic_grid(grid_size)
        height, width = grid_size
        if self.ar_preserving:
            if symbolic:
                raise ValueError(
                    "ar_preserving=True cuts a square resampling to each grid, which a graph with a dynamic grid "
                    f"cannot express; export at a fixed image size, got grid_size={grid_size}"
                )
            length_y = length_x = max(height, width)
        else:
            length_y, length_x = height, width
        rows = _resample_axis(self.pos_embed_y, length_y, symbolic)[:, :height]
        cols = _resample_axis(self.pos_embed_x, length_x, symbolic)[:, :width]
        return (rows[:, :, None] + cols[:, None]).flatten(1, 2)

    def forward(self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int) -> torch.Tensor:
        grid_size = self.check_tokens(x, grid_size, num_prefix_tokens, self.pos_embed_y.shape[-1])
        table = self.table(grid_size).to(x.dtype)
        if num_prefix_tokens:
            return torch.cat([x[:, :num_prefix_tokens], x[:, num_prefix_tokens:] + table], dim=1)
        return x + table

    def resample_table(self, name: str, value: torch.Tensor) -> torch.Tensor | None:
        """A table of a checkpoint trained at another grid, resampled to this one's length on its axis as
        :meth:`table` resamples; None when ``name`` is not ``pos_embed_y`` / ``pos_embed_x`` or ``value`` is not a
        (1, L, C) table of this width. The checkpoint loader (:func:`~visionpe.load_timm_state_dict`) calls it."""
        if name not in ("pos_embed_y", "pos_embed_x") or not isinstance(value, torch.Tensor):
            return None
        if value.ndim != 3 or value.shape[0] != 1 or value.shape[2] != self.pos_embed_y.shape[2]:
            return None
        length = self.grid_size[0] if name == "pos_embed_y" else self.grid_size[1]
        with torch.no_grad():
            return _resample_axis(value, length, False)

    def set_grid_size(self, grid_size: tuple[int, ...]) -> None:
        """Resample both tables to a new nominal grid (``model.set_input_size``)."""
        grid_size = self.check_grid(grid_size)
        if grid_size == self.grid_size:
            return
        with torch.no_grad():
            rows = _resample_axis(self.pos_embed_y, grid_size[0], False)
            cols = _resample_axis(self.pos_embed_x, grid_size[1], False)
        self.pos_embed_y = nn.Parameter(rows, requires_grad=self.pos_embed_y.requires_grad)
        self.pos_embed_x = nn.Parameter(cols, requires_grad=self.pos_embed_x.requires_grad)
        self.grid_size = grid_size
