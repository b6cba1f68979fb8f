"""RoPE-Axial: Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024 (naver-ai/rope-vit).

2D: half of the rotary pairs read x, half read y, with theta_n = base^(-4n/d), n < d/4 (base 100 for ViT):
phi_j = x * theta_j for j < d/4 and phi_j = y * theta_{j - d/4} otherwise. Interleaved pairs, `index` coords.
3D (video) [visionpe]: pairs are split (x, y, t) with counts (n_x, n_y, n_t), theta_{a,n} = base^(-n / n_a);
the default gives t a quarter of the pairs, e.g. (12, 12, 8) for head_dim 64.
``axis_order`` [visionpe] sets which axis the first block of pairs reads: ``"yx"`` gives the layout of EVA-02 and
timm's ``RotaryEmbeddingCat`` with ``grid_indexing="ij"`` (pairs [0, d/4) read y), the default ``"xy"`` rope-vit's.
``coord_offset`` [visionpe] adds a constant o to the integer positions before ``ref_scaled``'s scaling,
(i + o) * n_ref / n, as timm's ``grid_offset`` (Perception Encoder uses 1): patch-patch logits are unchanged (they
depend on differences), patch-prefix logits see the shift, as prefix tokens stay unrotated.
Nothing is learned; on a larger grid the table is rebuilt on integer positions (extrapolation).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ..checks import check_choice, check_float
from ..grid import grid_coords
from ..registry import register_scheme
from .base import LinearRotary
from .frequencies import axial_frequencies, check_axis_pairs, check_base, default_axis_pairs

__all__ = ["RopeAxial", "axial_frequencies", "check_axis_pairs", "check_base"]


@register_scheme("rope_axial")
class RopeAxial(LinearRotary):
    """Axial 2D/3D RoPE.

    Args:
        dim: model width; num_heads: heads; depth: blocks (unused, every block shares the table).
        base: frequency base (rope-vit uses 100 for ViT, Qwen 10000).
        ndim: 2 for images, 3 for video (t, y, x).
        axis_pairs: pairs per axis in order x, y[, t]; default (d/4, d/4) in 2D, d/8 pairs for t in 3D.
        axis_order: which axis each block of pairs reads, first block first: ``"xy"`` (default in 2D, rope-vit),
            ``"yx"`` (EVA-02, timm's ``grid_indexing="ij"``), or in 3D a permutation of ``"xyt"`` (default).
        coord_offset: added to every integer position (``index`` and ``ref_scaled`` coordinates) before scaling;
            0 (default) leaves the coordinates as they are.
        coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta, rotate_values: the shared rotary options, by
            keyword (:class:`~visionpe.rotary.base.RotaryOptions`: ``index``, the paper's integer positions, and no
            extrapolation by default).
    """

    axial_spectrum = True  # each pair turns with one axis: RIFLEx's bands (extrapolation="riflex", .scaling)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 100.0,
        ndim: int = 2,
        axis_pairs: Sequence[int] | None = None,
        axis_order: str | None = None,
        coord_offset: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, options=self.rotary_options(options))
        axis_pairs = check_axis_pairs(default_axis_pairs(self.head_dim, ndim) if axis_pairs is None else axis_pairs)
        if len(axis_pairs) != ndim:
            raise ValueError(f"axis_pairs must have {ndim} entries for ndim={ndim}, got {tuple(axis_pairs)}")
        self.base, self.axis_pairs = check_base(base), tuple(axis_pairs)
        axes = "xyt"[:ndim]
        orders = tuple("".join(p) for p in itertools.permutations(axes))
        self.axis_order = axes if axis_order is None else check_choice(axis_order, "axis_order", orders)
        self.coord_offset = check_float(coord_offset, "coord_offset")
        if self.coord_offset and self.coord_mode not in ("index", "ref_scaled"):
            raise ValueError(
                f"coord_offset shifts integer positions, so it takes coord_mode 'index' or 'ref_scaled', got "
                f"coord_mode={self.coord_mode!r} with coord_offset={coord_offset!r}"
            )
        self.register_buffer("freqs", self._frequency_table(), persistent=False)

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # fp32 under model.to(bfloat16) (angles grow with position, so bf16 frequencies would cost ~0.1 rad at
        # x = 63), as timm keeps its rotary bands; rebuilt after moves and to_empty by the base class
        return {"freqs": self._frequency_table()}

    def _frequency_table(self) -> torch.Tensor:
        """(ndim, head_dim // 2) frequencies, rows in coordinate order, pair blocks in ``axis_order``."""
        if self.axis_order == "xyt"[: self.ndim]:
            return axial_frequencies(self.head_dim, self.base, self.axis_pairs)
        blocks = [self.axis_pairs["xyt".index(axis)] for axis in self.axis_order]
        by_block = axial_frequencies(self.head_dim, self.base, blocks).flip(0)  # row b: block b's frequencies
        # coordinate column c is axis "xyt"[ndim - 1 - c]: (y, x) or (t, y, x)
        rows = [self.axis_order.index("xyt"[self.ndim - 1 - c]) for c in range(self.ndim)]
        return by_block[rows]

    def frequencies(self) -> torch.Tensor:
        return self.freqs[None, None]

    def coords(self, grid_size: tuple[int, ...], device=None) -> torch.Tensor:
        """The coordinate mode's coordinates; with ``coord_offset``, (i + o) or (i + o) * n_ref / n per axis."""
        if not self.coord_offset:
            return super().coords(grid_size, device)
        grid_size = self.check_grid(grid_size)
        coords = grid_coords(grid_size, device=device) + self.coord_offset
        if self.coord_mode == "ref_scaled":
            ratios = [r / n for r, n in zip(self.train_grid_size, grid_size, strict=True)]
            coords = coords * torch.tensor(ratios, device=coords.device)
        return coords

    def rotation_grid_size(self, coords: torch.Tensor, grid_size: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """As the base class, with ``coord_offset`` taken off integer coordinates before the grid is read off them
        (:meth:`coords` of an n-cell axis ends at n - 1 + o, not n - 1)."""
        if grid_size is None and self.coord_offset and self.coord_mode == "index":
            coords = coords - self.coord_offset
        return super().rotation_grid_size(coords, grid_size)
