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
its blocks from that small table (:meth:`ComRoPEAP.rotation_plan`, the word tables of all layers set up at once);
gradients flow through the exponentials exactly.

Extrapolation (``pos_norm='train_grid'``): PI divides the positions; NTK and YaRN rescale frequencies, which here
are the eigenfrequencies of each block [visionpe]. A skew S_j = Q diag(omega_k J) Q^T (J the 2 x 2 quarter turn)
turns by omega_k x per unit of its coordinate in plane k, so the generator of axis a becomes
S'_aj = Q diag(f_a(omega_k) J) Q^T = S_j phi_a(S_j^2), with f_a the rule of :func:`~visionpe.rotary.scaling.
scale_frequencies` on axis a (:meth:`ComRoPEBase.axis_skew_blocks`). Every S'_aj is a function of S_j, so the
generators still commute and the relative property stays exact.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..base import check_layer
from ..grid import grid_coords, validate_count
from ..registry import register_scheme
from .lie_base import LieBlockRotary
from .scaling import EXTRAPOLATION_MODES
from .skew_exp import block_skew_expm_layers

__all__ = ["ComRoPEBase", "ComRoPEAP"]

POS_NORMS = ("test_grid", "train_grid")


def distinct_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(x, return_inverse=True)``: the exponentials are built once per distinct coordinate value.

    Under ``torch.export`` (where the count of distinct values would be a data-dependent shape) every entry is
    its own value: the same rotations, one exponential per entry.
    """
    if torch.compiler.is_exporting():
        return x.flatten(), torch.arange(x.numel(), device=x.device).view(x.shape)
    return torch.unique(x, return_inverse=True)


class ComRoPEBase(LieBlockRotary):
    """Common ComRoPE options and constructor (arguments: :class:`ComRoPEAP`); subclasses build the commuting
    generators from the blocks P in :meth:`init_generators`."""

    _scales_own_coords = True
    supported_extrapolation = EXTRAPOLATION_MODES  # the blocks' eigenfrequencies (axis_skew_blocks)
    # exact relative property to 1e-5: each squaring doubles the error before it, so exponentials run in fp64
    # (cheap here: one per distinct coordinate value)
    series_dtype = torch.float64

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        block_size: int = 8,
        ndim: int = 2,
        init_std: float = 1.0,
        pos_norm: str = "test_grid",
        rotate_prefix: bool = True,
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        jitter_std: float = 0.0,
        offset_std: float = 0.0,
    ) -> None:
        if pos_norm not in POS_NORMS:
            raise ValueError(f"pos_norm must be one of {POS_NORMS}, got {pos_norm!r}")
        if pos_norm == "train_grid" and grid_size is None:
            raise ValueError("pos_norm='train_grid' needs grid_size (the training grid), got None")
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or not 0 <= init_std < math.inf:
            raise ValueError(f"init_std must be a finite non-negative number, got {init_std!r}")
        if not isinstance(rotate_prefix, bool):  # bool("no") is True
            raise ValueError(f"rotate_prefix must be a bool, got {rotate_prefix!r}")
        for name, value in (("jitter_std", jitter_std), ("offset_std", offset_std)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
        self.pos_norm = pos_norm
        super().__init__(dim, num_heads, depth, block_size, ndim, grid_size, extrapolation)
        self.rotate_prefix, self.init_std = bool(rotate_prefix), float(init_std)
        self.jitter_std, self.offset_std = float(jitter_std), float(offset_std)
        self.coord_mode = "normalized"
        self.blocks = nn.Parameter(torch.randn(depth, num_heads, self.num_blocks, block_size, block_size) * init_std)
        self.init_generators()

    @abstractmethod
    def init_generators(self) -> None:
        """The variant's own parameters and buffers, after the common ones (called by the constructor)."""

    def extrapolation_refusal(self, mode: str, train_grid_size: tuple[int, ...] | None = None) -> str | None:
        if mode != "none" and self.pos_norm == "test_grid":
            return (
                f"extrapolation={mode!r} with pos_norm='test_grid' would scale twice: positions normalised by the "
                "test grid already interpolate; use pos_norm='train_grid'"
            )
        return super().extrapolation_refusal(mode, train_grid_size)

    def coords(self, grid_size: tuple[int, ...], device=None) -> torch.Tensor:
        grid_size = self.check_grid(grid_size)
        if self.pos_norm == "test_grid":
            return grid_coords(grid_size, mode="normalized", device=device)
        ref = torch.tensor(self.train_grid_size, dtype=torch.float32, device=device)
        return (grid_coords(grid_size, mode="index", device=device) + 0.5) / ref

    def prefix_coords(
        self, num_prefix_tokens: int, coords: torch.Tensor, grid_size: Sequence[int] | None = None
    ) -> torch.Tensor | None:
        """(num_prefix_tokens, ndim) positions of the prefix tokens, all at the centre of the grid, or None
        (``rotate_prefix=False``: the identity).

        The centre is 0.5 per axis with ``pos_norm='test_grid'``; with ``'train_grid'`` it is n_a / (2 n_train_a)
        for ``grid_size`` (0.5 on the training grid), or without ``grid_size`` the middle of the extent of
        ``coords`` (the same for a whole grid).
        """
        if not self.rotate_prefix:
            return None
        if self.pos_norm == "test_grid":
            centre = coords.new_full((coords.shape[1],), 0.5)
        elif grid_size is not None:
            sizes = torch.tensor(tuple(grid_size), dtype=torch.float64) / torch.tensor(self.train_grid_size)
            centre = (sizes / 2).to(coords)
        elif len(coords):
            centre = (coords.amin(0) + coords.amax(0)) / 2
        else:
            centre = coords.new_full((coords.shape[1],), 0.5)
        return centre.expand(num_prefix_tokens, -1)

    def prepare(self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None):
        """As :meth:`LieBlockRotary.prepare`, with the prefix tokens placed at the grid centre
        (``rotate_prefix=True``: they are then rotated like patch tokens and the state has no unrotated prefix),
        and in training mode the augmentations (:meth:`augment`) applied to the positions first."""
        validate_count(num_prefix_tokens, "num_prefix_tokens")
        grid_size = None if grid_size is None else self.check_grid(grid_size)  # sets the prefix centre and cells
        coords = coords.float()
        prefix = self.prefix_coords(num_prefix_tokens, coords, grid_size) if num_prefix_tokens else None
        if prefix is not None:
            coords, num_prefix_tokens, rotated = torch.cat((prefix, coords)), 0, len(prefix)
        else:
            rotated = 0
        if self.training and (self.jitter_std or self.offset_std):
            coords = self.augment(coords, rotated, grid_size)
        return super().prepare(coords, num_prefix_tokens, grid_size)

    def cell_sizes(self, coords: torch.Tensor, grid_size: Sequence[int] | None = None) -> torch.Tensor:
        """(ndim,) width of one grid cell per axis in the units of the positions: 1 / n_train_a with
        ``pos_norm='train_grid'``, 1 / n_a with ``'test_grid'`` (n from ``grid_size``, or without it the count of
        distinct values of each axis of ``coords``: the grid side for a whole grid)."""
        if self.pos_norm == "train_grid":
            sides = torch.tensor(self.train_grid_size, dtype=torch.float32, device=coords.device)
        elif grid_size is not None:
            sides = torch.tensor(tuple(grid_size), dtype=torch.float32, device=coords.device)
        else:
            sides = torch.tensor([len(torch.unique(c)) for c in coords.unbind(1)], dtype=torch.float32)
        return 1.0 / sides.to(coords.device).clamp_min(1)

    def augment(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The reference's training augmentations of the positions ``coords`` (P + N, ndim), whose first
        ``num_prefix_tokens`` rows are (rotated) prefix tokens: every patch position moves by Gaussian jitter of
        std ``jitter_std`` cells clamped to +-0.5 cell (the time axis of a 3D grid is not jittered, as in the
        reference), then every token, prefix included, by one global offset ~ N(0, offset_std^2) per axis.

        Called by :meth:`prepare` in training mode only; returns ``coords`` unchanged when both are 0.
        """
        if self.jitter_std and len(coords) > num_prefix_tokens:
            patches = coords[num_prefix_tokens:]
            noise = (torch.randn_like(patches) * self.jitter_std).clamp(-0.5, 0.5) * self.cell_sizes(patches, grid_size)
            if self.ndim == 3:  # (t, y, x): frames are not jittered
                noise[:, 0] = 0
            coords = torch.cat((coords[:num_prefix_tokens], patches + noise))
        if self.offset_std:
            coords = coords + torch.randn(coords.shape[1], device=coords.device) * self.offset_std
        return coords

    def rotations(self, coords: torch.Tensor, layer: int) -> torch.Tensor:
        return self.rotation_chunks(coords, layer)(0, len(coords))

    def rotation_chunks(self, coords: torch.Tensor, layer: int) -> Callable[[int, int], torch.Tensor]:
        check_layer(layer, self.depth, type(self).__name__)
        return self.rotation_plan(coords)(layer)

    def skew_blocks(self, layer: int) -> torch.Tensor:
        """(num_heads, m, b, b) skew blocks P_j - P_j^T of block ``layer``."""
        p = self.blocks[layer if self.blocks.shape[0] > 1 else 0]
        return p - p.transpose(-1, -2)

    def layer_skew_blocks(self) -> torch.Tensor:
        """(L, num_heads, m, b, b) skew blocks of every layer."""
        return self.blocks - self.blocks.transpose(-1, -2)

    @abstractmethod
    def axis_coefficients(self) -> torch.Tensor:
        """(L | 1, ndim, m): along axis a, block j's exponent is ``coefficient[a, j] * x_a`` times its skew block."""

    def axis_skew_blocks(self, factors: Sequence[float]) -> torch.Tensor:
        """(L, ndim, num_heads, m, b, b) float64: per axis a, every skew block S with each eigenfrequency rescaled
        by the NTK or YaRN rule of the current mode for the per-axis ``factors``.

        The frequency of plane k of block j along axis a, per grid cell, is |c_aj| omega_k / n0_a (positions are
        (i + 0.5) / n0_a), which is what :func:`~visionpe.rotary.scaling.scale_frequencies` rescales (NTK's band
        index per axis, layer and head; YaRN's turns over the training grid). The eigenbasis comes from
        ``eigh(S^2)`` (S^2 = -S^T S has eigenvalues -omega_k^2), in fp64 and without gradient: as the frequency
        rules do for learned frequencies, the factor phi_a(S^2) is a constant of the backward, and gradients flow
        through S.
        """
        skew = self.layer_skew_blocks()
        with torch.no_grad():
            square = skew.detach().double()
            eigvals, basis = torch.linalg.eigh(square @ square)  # (L, h, m, b), columns of basis
            omega = (-eigvals).clamp_min(0).sqrt()  # each plane's frequency twice (and 0 for a fixed direction)
            cells = torch.tensor(self.train_grid_size, dtype=torch.float64, device=skew.device)
            coeff = self.axis_coefficients().detach().double() / cells[:, None]  # (L | 1, ndim, m)
            freqs = coeff[:, None, :, :, None] * omega[:, :, None]  # (L, h, ndim, m, b)
            ratio = self.frequency_multipliers(freqs.flatten(-2), factors).view_as(freqs)
            # phi_a(S^2) = U diag(ratio) U^T, per axis
            phi = (basis.unsqueeze(2) * ratio.unsqueeze(-2)) @ basis.unsqueeze(2).transpose(-1, -2)
        out = skew.double().unsqueeze(2) @ phi  # (L, h, ndim, m, b, b)
        return ((out - out.transpose(-1, -2)) / 2).transpose(1, 2)  # skew to rounding; (L, ndim, h, m, b, b)


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
    """

    def init_generators(self) -> None:
        ndim = self.ndim
        if self.num_blocks < ndim:  # block j belongs to axis j mod ndim: every axis needs one
            raise ValueError(
                f"block_size must leave head_dim // block_size >= ndim blocks (one per axis), got block_size="
                f"{self.block_size} with head_dim={self.head_dim}, ndim={ndim}"
            )
        axis = torch.arange(self.num_blocks) % ndim
        self.register_buffer("axis_mask", (axis.unsqueeze(1) == torch.arange(ndim)).float(), persistent=False)

    def generators(self, layer: int) -> torch.Tensor:
        # (h, m, 1, b, b) * (m, ndim, 1, 1): block j only on axis j mod ndim
        return self.skew_blocks(layer).unsqueeze(2) * self.axis_mask[:, :, None, None]

    def axis_coefficients(self) -> torch.Tensor:
        return self.axis_mask.T.unsqueeze(0)

    def rotation_plan(
        self, coords: torch.Tensor, factors: Sequence[float] | None = None
    ) -> Callable[[int], Callable[[int, int], torch.Tensor]]:
        # (L, h, m, b, b) skew blocks, or per axis (NTK / YaRN: each axis' frequencies rescaled)
        skew = self.layer_skew_blocks() if factors is None else self.axis_skew_blocks(factors)
        heads, blocks, b = self.num_heads, self.num_blocks, self.block_size
        builders, offsets, index = [], 0, torch.empty(len(coords), blocks, dtype=torch.long, device=coords.device)
        for axis in range(self.ndim):
            # blocks axis, axis + ndim, ... turn with this coordinate only: exp(v S_j) for its distinct values v,
            # the word tables of all layers set up at once
            values, inverse = distinct_values(coords[:, axis])
            own = torch.arange(axis, blocks, self.ndim, device=coords.device)
            gen = skew if factors is None else skew[:, axis]
            build = block_skew_expm_layers(gen[:, :, own, None], values[:, None], self.series_dtype)
            builders.append((build, len(values)))
            # token n, block own[k] reads row inverse[n] * m_a + k of this axis' table
            index[:, own] = offsets + inverse[:, None] * len(own) + torch.arange(len(own), device=coords.device)
            offsets += len(values) * len(own)
        last = len(skew) - 1

        def plan(layer: int) -> Callable[[int, int], torch.Tensor]:
            # (h, V_a, m_a, b, b) per axis, one table of rows
            table = torch.cat([build(min(layer, last), 0, count).flatten(1, 2) for build, count in builders], 1)

            def gather(start: int, stop: int) -> torch.Tensor:
                # one gather builds every token's blocks, already in the (h, n, m) layout the product reads
                return table.index_select(1, index[start:stop].flatten()).view(heads, stop - start, blocks, b, b)

            return gather

        return plan
