"""RoPE-Axial: Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024 (naver-ai/rope-vit).

2D: half of the rotary pairs read x, half read y, with theta_n = base^(-4n/d), n < d/4 (base 100 for ViT):
phi_j = x * theta_j for j < d/4 and phi_j = y * theta_{j - d/4} otherwise. Interleaved pairs, `index` coords.
3D (video) [visionpe]: pairs are split (x, y, t) with counts (n_x, n_y, n_t), theta_{a,n} = base^(-n / n_a);
the default gives t a quarter of the pairs, e.g. (12, 12, 8) for head_dim 64.
Nothing is learned; on a larger grid the table is rebuilt on integer positions (extrapolation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
        coord_mode: grid convention (``index`` = the paper's integer positions).
        grid_size: training grid (the model passes it); the reference of ``extrapolation``.
        extrapolation: ``none`` (default), ``pi``, ``ntk`` or ``yarn`` scaling at a larger grid
            (:mod:`visionpe.rotary.scaling`).
        yarn_alpha, yarn_beta: YaRN ramp bounds.
        rotate_values: rotary value embeddings (RoVE): rotate v by the keys' positions and attention's output back
            by the queries' (:mod:`visionpe.rotary.base`); False by default.
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
        coord_mode: str = "index",
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
        rotate_values: bool = False,
    ) -> None:
        super().__init__(
            dim,
            num_heads,
            depth,
            ndim,
            coord_mode,
            grid_size,
            extrapolation,
            yarn_alpha,
            yarn_beta,
            rotate_values=rotate_values,
        )
        axis_pairs = check_axis_pairs(default_axis_pairs(self.head_dim, ndim) if axis_pairs is None else axis_pairs)
        if len(axis_pairs) != ndim:
            raise ValueError(f"axis_pairs must have {ndim} entries for ndim={ndim}, got {tuple(axis_pairs)}")
        self.base, self.axis_pairs = check_base(base), tuple(axis_pairs)
        self.register_buffer("freqs", axial_frequencies(self.head_dim, base, axis_pairs), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return self.freqs[None, None]

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        # model.to(bfloat16) casts every floating buffer; fixed frequencies are rebuilt in fp32 (angles grow with
        # position, so bf16 frequencies would cost ~0.1 rad at x = 63), as timm does for its rotary bands
        if torch.finfo(self.freqs.dtype).bits < 32:
            freqs = axial_frequencies(self.head_dim, self.base, self.axis_pairs).to(self.freqs.device)
            self.register_buffer("freqs", freqs, persistent=False)
        return module
