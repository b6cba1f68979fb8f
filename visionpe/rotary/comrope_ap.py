"""ComRoPE-AP: Yu et al., "ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable
Commuting Angle Matrices", CVPR 2025 (Longin-Yu/ComRoPE).

R(x) = exp(sum_i A_i x_i), A_i = blockdiag(B_i1, ..., B_im) of b x b skew blocks. Axial partition (AP):
B_ij = P_j - P_j^T if j mod n_axes = i, else 0: every block belongs to one axis, so the A_i commute and
R(x)^T R(y) = R(y - x) exactly. P: (h, m, b, b) ~ N(0, init_std^2) per layer. b = 2 with fixed P is axial RoPE.
Positions `normalized`, (i + 0.5) / n per axis (``pos_norm='test_grid'``) or / n_train (``'train_grid'``)
[visionpe]. Prefix tokens (cls, registers) are rotated at the centre of the grid, as the reference rotates its cls
token (``prepend_cls=True``, ``cls_position=0.5``): ``rotate_prefix=True``, the default; (0.5, ..., 0.5) with
``'test_grid'``, n_a / (2 n_train_a) with ``'train_grid'`` (0.5 on the training grid). ``rotate_prefix=False``
leaves them unrotated (the identity).
Training augmentations of the reference, off by default (``0.0``) and applied only in training mode
(``module.training``, so never at evaluation), once per forward (:meth:`ComRoPEBase.prepare`):
``jitter_std``, Gaussian jitter of every patch position with std ``jitter_std`` cells, clamped to +-0.5 cell (the
reference's ``perturbation_intensity`` p is ``jitter_std = p / 2``; as there, the time axis of 3D grids is not
jittered); ``offset_std``, one global shift of every token (prefix included) ~ N(0, offset_std^2) per axis, in the
units of the positions (the grid is 1 wide with ``'test_grid'``); by the exact relative property it leaves the
attention logits unchanged up to rounding (it matters only where something else reads absolute positions).
Rotations are applied per block, never as (B, L, h, d, d) matrices.

Cost: block j of a token turns by exp(x_a S_j) with one fixed skew S_j = P_j - P_j^T, so the exponentials are taken
once per distinct value of each coordinate (a grid has H distinct y and W distinct x) and every token gathers
its blocks from that small table (:class:`AxialTables`, the word tables of all layers set up at once);
gradients flow through the exponentials exactly.

Extrapolation (``pos_norm='train_grid'``): PI divides the positions; NTK and YaRN rescale frequencies, which here
are the eigenfrequencies of each block [visionpe]. A skew S_j = Q diag(omega_k J) Q^T (J the 2 x 2 quarter turn)
turns by omega_k x per unit of its coordinate in plane k, so the generator of axis a becomes
S'_aj = Q diag(f_a(omega_k) J) Q^T = S_j phi_a(S_j^2), with f_a the rule of :func:`~visionpe.rotary.scaling.
scale_frequencies` on axis a
(:meth:`~visionpe.rotary.comrope_base.ComRoPEBase.axis_skew_blocks`). Every S'_aj is a function of S_j, so the
generators still commute and the relative property stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..registry import register_scheme
from .block_rotation import TokenRotations
from .comrope_base import ComRoPEBase, distinct_values
from .expm import LayerExponentials

__all__ = ["ComRoPEAP"]


@register_scheme("comrope_ap")
class ComRoPEAP(ComRoPEBase):
    """ComRoPE with axial partition.

    Args:
        dim, num_heads, depth: model shape; one P per layer.
        block_size: b, 8 by default (2 gives axial RoPE with learnable angles).
        ndim: 2 (y, x) or 3 (t, y, x); block j rotates with axis j mod ndim.
        init_std: P ~ N(0, init_std^2).
        pos_norm: ``test_grid`` ((i + 0.5) / n) or ``train_grid`` ((i + 0.5) / n_train, extrapolates).
        rotate_prefix: True (default, as the reference): prefix tokens (cls, registers) are rotated at the grid
            centre (:meth:`prefix_coords`); False: they get the identity.
        grid_size: training grid (the model passes it).
        extrapolation: ``none``, or with ``pos_norm='train_grid'``: ``pi``, ``ntk`` or ``yarn`` (the eigenfrequencies
            of each block rescaled per axis).
        jitter_std: training only: std in cells of the Gaussian jitter of each patch position, clamped to +-0.5
            cell (the reference's perturbation intensity / 2); 0 (default) turns it off.
        offset_std: training only: std of one global offset of all positions per forward, in position units;
            0 (default) turns it off. Both are finite non-negative numbers (:meth:`augment`).
        rotate_values: rotary value embeddings (RoVE): v_j -> R(x_j) v_j and o_i -> R(x_i)^T o_i, exactly relative
            (:mod:`visionpe.rotary.lie_base`); False by default.
        time_norm: 3D grids only: ``frames`` (default, t = (f + 0.5) / T) or ``spatial`` (t = (f + 0.5) / W, the
            reference code's convention: it divides the frame index by the spatial side); see
            :mod:`~visionpe.rotary.comrope_base`.
    """

    def init_generators(self) -> None:
        ndim = self.ndim
        if self.num_blocks < ndim:  # block j belongs to axis j mod ndim: every axis needs one
            raise ValueError(
                f"block_size must leave head_dim // block_size >= ndim blocks (one per axis), got block_size="
                f"{self.block_size} with head_dim={self.head_dim}, ndim={ndim}"
            )
        self.register_buffer("axis_mask", self._axis_mask(), persistent=False)

    def _axis_mask(self) -> torch.Tensor:
        """(num_blocks, ndim) 0/1: block j belongs to axis j mod ndim."""
        axis = torch.arange(self.num_blocks) % self.ndim
        return (axis.unsqueeze(1) == torch.arange(self.ndim)).float()

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        return {"axis_mask": self._axis_mask()}

    def generators(self, layer: int) -> torch.Tensor:
        # (h, m, 1, b, b) * (m, ndim, 1, 1): block j only on axis j mod ndim
        return self.skew_blocks(layer).unsqueeze(2) * self.axis_mask[:, :, None, None]

    def axis_coefficients(self) -> torch.Tensor:
        return self.axis_mask.T.unsqueeze(0)

    def rotation_plan(
        self, coords: torch.Tensor, factors: Sequence[float] | None = None
    ) -> Callable[[int], TokenRotations]:
        # (L, h, m, b, b) skew blocks, or per axis (NTK / YaRN: each axis' frequencies rescaled)
        skew = self.layer_skew_blocks() if factors is None else self.axis_skew_blocks(factors)
        blocks = self.num_blocks
        axes, offsets, index = [], 0, torch.empty(len(coords), blocks, dtype=torch.long, device=coords.device)
        for axis in range(self.ndim):
            # blocks axis, axis + ndim, ... turn with this coordinate only: exp(v S_j) for its distinct values v,
            # the word tables of all layers set up at once
            values, inverse = distinct_values(coords[:, axis])
            own = torch.arange(axis, blocks, self.ndim, device=coords.device)
            gen = skew if factors is None else skew[:, axis]
            axes.append(LayerExponentials(gen[:, :, own, None], values[:, None], self.series_dtype))
            # token n, block own[k] reads row inverse[n] * m_a + k of this axis' table
            index[:, own] = offsets + inverse[:, None] * len(own) + torch.arange(len(own), device=coords.device)
            offsets += len(values) * len(own)
        return AxialTables(axes, index, self.block_size).layer


class AxialTables:
    """ComRoPE-AP's exponentials for one forward: per axis, exp(v S_j) of the blocks of that axis at each distinct
    coordinate value v (:class:`~visionpe.rotary.expm.LayerExponentials`), and ``index`` (N, m), the table row of
    every token's block."""

    def __init__(self, axes: Sequence[LayerExponentials], index: torch.Tensor, block_size: int) -> None:
        self.axes, self.index, self.block_size = list(axes), index, block_size

    def layer(self, layer: int) -> GatheredRotations:
        """Block ``layer``'s rotations: its tables of every axis, (h, sum_a V_a m_a, b, b) rows, then gathered."""
        table = torch.cat([exps.layer(layer)(0, exps.num_tokens).flatten(1, 2) for exps in self.axes], 1)
        return GatheredRotations(table, self.index, self.block_size)


class GatheredRotations(TokenRotations):
    """Every token's blocks gathered from one table of rows (h, R, b, b) by ``index`` (N, m)."""

    def __init__(self, table: torch.Tensor, index: torch.Tensor, block_size: int) -> None:
        self.table, self.index, self.block_size, self.num_tokens = table, index, block_size, len(index)

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        # one gather builds every token's blocks, already in the (h, n, m) layout the product reads
        rows = self.table.index_select(1, self.index[start:stop].flatten())
        return rows.view(len(self.table), stop - start, self.index.shape[1], self.block_size, self.block_size)
