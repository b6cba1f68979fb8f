"""RoPE-Mixed: Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024 (naver-ai/rope-vit).

Learnable frequencies f in R^{2 x L x h x d/2} per layer and head: phi_j(x, y) = x f_{x,j} + y f_{y,j}.
Init: a ~ U[0, 2pi), mag_n = base^(-4n/d) (base 10), f_x = [mag cos a || mag cos(a + pi/2)],
f_y = [mag sin a || mag sin(a + pi/2)]. Frequencies are excluded from weight decay.
3D [visionpe]: a third component f_t = [mag cos b || mag sin b] with its own random b: a zero-initialised
temporal component stays unused (author's note), so it starts non-zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..registry import register_scheme
from .base import LinearRotary
from .rope_axial import check_base

__all__ = ["RopeMixed", "init_mixed_frequencies"]


def init_mixed_frequencies(head_dim: int, depth: int, num_heads: int, base: float = 10.0, ndim: int = 2):
    """(ndim, depth, num_heads, head_dim // 2) frequencies in component order x, y[, t] (timm's layout)."""
    mag = base ** (-torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
    a = torch.rand(depth, num_heads, 1) * 2 * math.pi
    f_x = torch.cat([mag * torch.cos(a), mag * torch.cos(a + math.pi / 2)], dim=-1)
    f_y = torch.cat([mag * torch.sin(a), mag * torch.sin(a + math.pi / 2)], dim=-1)
    comps = [f_x, f_y]
    if ndim == 3:
        b = torch.rand(depth, num_heads, 1) * 2 * math.pi
        comps.append(torch.cat([mag * torch.cos(b), mag * torch.sin(b)], dim=-1))
    return torch.stack(comps)


@register_scheme("rope_mixed")
class RopeMixed(LinearRotary):
    """Learnable per-layer, per-head 2D/3D rotary frequencies.

    Args:
        dim, num_heads, depth: model shape; one frequency set per block and head.
        base: magnitude base of the init (rope-vit uses 10).
        ndim: 2 for images, 3 for video.
        coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta, rotate_values: the shared rotary options, by
            keyword (:class:`~visionpe.rotary.base.RotaryOptions`: ``index`` as in the paper, no extrapolation). Under
            ``pi``, ``ntk`` or ``yarn`` each component f_{a,n} is scaled with its own axis wavelength
            2 pi / |f_{a,n}| (see :mod:`visionpe.rotary.scaling`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 10.0,
        ndim: int = 2,
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, options=self.rotary_options(options))
        self.base = check_base(base)
        self.freqs = nn.Parameter(init_mixed_frequencies(self.head_dim, depth, num_heads, base, ndim))

    def frequencies(self) -> torch.Tensor:
        # parameter components are x, y[, t]; coordinate columns are (y, x) or (t, y, x)
        return self.freqs.flip(0).permute(1, 2, 0, 3)

    def no_weight_decay(self) -> set[str]:
        return {"freqs"}
