"""Cayley-STRING: Schenck et al., "Learning the RoPEs: Better 2D and 3D Position Encodings with STRING", ICML 2025.

R(r) = RoPE(r) P with P = (I - S)(I + S)^-1, S = A - A^T: one learned orthogonal matrix per layer and head,
shared by q, k and every token, and RoPE(r) with learned frequencies phi_j = sum_k r_k theta_{k,j}. Exactly
relative: R(r_i)^T R(r_j) = P^T RoPE(r_j - r_i) P. Init S = 0, theta = axial RoPE (base 100): exactly RoPE-Axial.

Shared STRING machinery (P folded into the projections, RGB-D positions): :mod:`.string_base`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..checks import check_bool
from ..registry import register_scheme
from .expm import skew_from_params
from .frequencies import axial_frequencies, check_base, default_axis_pairs
from .string_base import StringBase, fold_string_

__all__ = ["StringCayley", "cayley_orthogonal", "fold_string_"]


def cayley_orthogonal(skew: torch.Tensor) -> torch.Tensor:
    """P = (I - S)(I + S)^-1 for skew-symmetric S (..., d, d), in fp32; (I - S) and (I + S)^-1 commute.

    Example:
        >>> cayley_orthogonal(torch.zeros(2, 2))
        tensor([[1., 0.],
                [0., 1.]])
    """
    if skew.ndim < 2 or skew.shape[-1] != skew.shape[-2]:
        raise ValueError(f"skew must have shape (..., d, d), got {tuple(skew.shape)}")
    with torch.autocast(skew.device.type, enabled=False):
        skew = skew.float()
        eye = torch.eye(skew.shape[-1], device=skew.device)
        # I + S is invertible for every skew S (eigenvalues 1 + i lambda): solve_ex skips linalg.solve's error
        # check, which on a GPU reads a status back from the device (a sync in every forward)
        return torch.linalg.solve_ex(eye + skew, eye - skew)[0]


@register_scheme("string_cayley")
class StringCayley(StringBase):
    """Cayley-STRING for 2D (y, x) or 3D coordinates.

    Args:
        dim, num_heads, depth: model shape; one P and one frequency set per block and head.
        base: base of the axial RoPE frequencies the learned frequencies start from (100, as RoPE-Axial).
        ndim: 2 for images, 3 for (t, y, x) video or (z, y, x) RGB-D positions passed to ``rotate``.
        learn_frequencies: learn theta (the paper learns all angle frequencies) or keep axial RoPE's.
        depth_coords: RGB-D: on a 2D image grid, rotate by r = (z, y, x) with z a learned linear
            function of each patch's mean depth (:meth:`~StringBase.depth_positions`); the model then takes
            ``depth=`` (B, 1, H, W). Needs ``ndim=2`` (the model's) and ``extrapolation='none'``.
        coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta, rotate_values: the shared rotary options, by
            keyword (:class:`~visionpe.rotary.base.RotaryOptions`); the extrapolation modes scale the RoPE part,
            ``rotate_values`` maps v_j -> R(r_j) v_j and o_i -> R(r_i)^T o_i (:mod:`visionpe.rotary.string_base`).
    """

    onnx_refusal = "torch.linalg.solve_ex (the Cayley transform) has no ONNX translation; fold_string_ first"

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 100.0,
        ndim: int = 2,
        learn_frequencies: bool = True,
        depth_coords: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, depth_coords, self.rotary_options(options))
        ndim = self.ndim  # 3 with depth_coords: (z, y, x)
        check_base(base)
        check_bool(learn_frequencies, "learn_frequencies")
        if ndim == 3 and self.head_dim < 8:  # the t axis gets head_dim // 8 frequency pairs
            raise ValueError(
                f"head_dim must be >= 8 for ndim=3 (a frequency pair per axis), got head_dim={self.head_dim}"
            )
        pairs = self.head_dim // 2
        axis_pairs = default_axis_pairs(self.head_dim, ndim)
        freqs = axial_frequencies(self.head_dim, base, axis_pairs).expand(depth, num_heads, ndim, pairs).clone()
        self.freqs = nn.Parameter(freqs, requires_grad=learn_frequencies)
        # S = A - A^T from the strictly upper entries of A: d (d - 1) / 2 numbers per layer and head
        count = self.head_dim * (self.head_dim - 1) // 2
        self.skew_params = nn.Parameter(torch.zeros(depth, num_heads, count))
        self.base = float(base)

    def frequencies(self) -> torch.Tensor:
        return self.freqs

    def string_basis(self) -> torch.Tensor:
        return cayley_orthogonal(skew_from_params(self.skew_params, self.head_dim))

    def no_weight_decay(self) -> set[str]:
        """The frequencies and the skew parameters of P (decay would pull P towards the identity, i.e. RoPE)."""
        return super().no_weight_decay() | {"freqs", "skew_params"}
