"""What ComRoPE-AP and ComRoPE-LD share (Yu et al., "ComRoPE: Scalable and Robust Rotary Position Embedding
Parameterized by Trainable Commuting Angle Matrices", CVPR 2025): options, positions, prefix handling, the
training augmentations and the eigenfrequency rescaling for extrapolation. See :mod:`.comrope_ap` for the scheme.

Video grids (t, y, x): every axis is normalised by its own count, t by the number of frames, (f + 0.5) / T
(``time_norm='frames'``, the default) [visionpe]. The reference code divides the frame index by the spatial side
instead, (f + 0.5) / n_side, the same divisor as y and x on its square grids; ``time_norm='spatial'`` does that
(the side is the grid's width W, or the training width with ``pos_norm='train_grid'``). The two differ by the factor
T / W on the time axis, so a checkpoint trained with the reference's convention needs ``time_norm='spatial'``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from ..base import check_layer
from ..checks import check_bool, check_float
from ..grid import grid_coords, validate_count
from .block_rotation import TokenRotations
from .lie_base import LieBlockRotary
from .scaling import SCALING_MODES

__all__ = ["ComRoPEBase", "POS_NORMS", "TIME_NORMS", "distinct_counts", "distinct_values"]

POS_NORMS = ("test_grid", "train_grid")
TIME_NORMS = ("frames", "spatial")


def distinct_counts(coords: torch.Tensor) -> torch.Tensor:
    """(ndim,) float32 count of the distinct values of each column of ``coords`` (N, ndim): ``len(torch.unique(c))``
    per column, from a sort (a tensor, not a data-dependent shape). 0 for no rows.
    """
    if coords.ndim != 2:
        raise ValueError(f"coords must have shape (N, ndim), got {tuple(coords.shape)}")
    ordered = coords.sort(0).values
    steps = (ordered[1:] != ordered[:-1]).sum(0)  # a new value after each step
    return (steps + (len(coords) > 0)).float()


def distinct_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(x, return_inverse=True)``: the exponentials are built once per distinct coordinate value.

    Under ``torch.compile`` and ``torch.export`` (where the count of distinct values would be a data-dependent
    shape, a graph break) every entry is its own value: the same rotations, one exponential per entry.
    """
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return x.flatten(), torch.arange(x.numel(), device=x.device).view(x.shape)
    return torch.unique(x, return_inverse=True)


class ComRoPEBase(LieBlockRotary):
    """Common ComRoPE options and constructor (arguments: :class:`ComRoPEAP`); subclasses build the commuting
    generators from the blocks P in :meth:`init_generators`."""

    _scales_own_coords = True
    supported_extrapolation = SCALING_MODES  # the blocks' eigenfrequencies (axis_skew_blocks)
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
        rotate_values: bool = False,
        time_norm: str = "frames",
    ) -> None:
        if pos_norm not in POS_NORMS:
            raise ValueError(f"pos_norm must be one of {POS_NORMS}, got {pos_norm!r}")
        if not isinstance(time_norm, str) or time_norm not in TIME_NORMS:
            raise ValueError(f"time_norm must be one of {TIME_NORMS}, got {time_norm!r}")
        if time_norm == "spatial" and ndim != 3:
            raise ValueError(
                f"time_norm='spatial' normalises the time axis of a 3D (t, y, x) grid, got ndim={ndim!r}; "
                "leave time_norm='frames' for images"
            )
        if pos_norm == "train_grid" and grid_size is None:
            raise ValueError("pos_norm='train_grid' needs grid_size (the training grid), got None")
        for name, value in (("init_std", init_std), ("jitter_std", jitter_std), ("offset_std", offset_std)):
            check_float(value, name, min=0, expected="a finite non-negative number")
        check_bool(rotate_prefix, "rotate_prefix")  # bool("no") is True
        self.pos_norm, self.time_norm = pos_norm, time_norm
        super().__init__(dim, num_heads, depth, block_size, ndim, grid_size, extrapolation, rotate_values)
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

    def axis_divisors(self, grid_size: Sequence[int]) -> tuple[int, ...]:
        """The count n_a that divides (i + 0.5) on each axis of ``grid_size`` (the test or the training grid): the
        axis' own size, except the time axis of a 3D grid with ``time_norm='spatial'``, which takes the width."""
        sizes = tuple(int(n) for n in grid_size)
        return tuple(sizes[axis] for axis in self._divisor_axes(len(sizes)))

    def _divisor_axes(self, ndim: int) -> tuple[int, ...]:
        """The axis whose count divides each axis (:meth:`axis_divisors`): itself, except the width for the time
        axis of a 3D grid with ``time_norm='spatial'``."""
        axes = tuple(range(ndim))
        return (axes[-1], *axes[1:]) if self.time_norm == "spatial" else axes

    def coords(self, grid_size: tuple[int, ...], device=None) -> torch.Tensor:
        grid_size = self.check_grid(grid_size)
        if self.pos_norm == "test_grid" and self.time_norm == "frames":
            return grid_coords(grid_size, mode="normalized", device=device)
        ref_grid = grid_size if self.pos_norm == "test_grid" else self.train_grid_size
        ref = torch.tensor(self.axis_divisors(ref_grid), dtype=torch.float32, device=device)
        return (grid_coords(grid_size, mode="index", device=device) + 0.5) / ref

    def prefix_coords(
        self, num_prefix_tokens: int, coords: torch.Tensor, grid_size: Sequence[int] | None = None
    ) -> torch.Tensor | None:
        """(num_prefix_tokens, ndim) positions of the prefix tokens, all at the centre of the grid, or None
        (``rotate_prefix=False``: the identity).

        The centre is 0.5 per axis with ``pos_norm='test_grid'`` (the reference's ``cls_position``, the time axis
        included whatever ``time_norm``); with ``'train_grid'`` it is n_a / (2 d_a) for ``grid_size``, d_a the
        axis' divisor on the training grid (:meth:`axis_divisors`; 0.5 on the training grid with
        ``time_norm='frames'``), or without ``grid_size`` the middle of the extent of ``coords`` (the same for a
        whole grid).
        """
        if not self.rotate_prefix:
            return None
        if self.pos_norm == "test_grid":
            centre = coords.new_full((coords.shape[1],), 0.5)
        elif grid_size is not None:
            divisors = torch.tensor(self.axis_divisors(self.train_grid_size), dtype=torch.float64)
            sizes = torch.tensor(tuple(grid_size), dtype=torch.float64) / divisors
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
        """(ndim,) width of one grid cell per axis in the units of the positions: 1 / d_a, d_a the axis' divisor
        (:meth:`axis_divisors`) on the training grid with ``pos_norm='train_grid'``, on ``grid_size`` with
        ``'test_grid'`` (without ``grid_size``, the count of distinct values of each axis of ``coords``: the grid
        side for a whole grid, the width for the time axis with ``time_norm='spatial'``)."""
        if self.pos_norm == "train_grid":
            sides = torch.tensor(self.axis_divisors(self.train_grid_size), dtype=torch.float32, device=coords.device)
        elif grid_size is not None:
            sides = torch.tensor(self.axis_divisors(grid_size), dtype=torch.float32, device=coords.device)
        else:  # counted on the device (no data-dependent shape, so a compiled graph does not break here)
            sides = distinct_counts(coords)[list(self._divisor_axes(coords.shape[1]))]
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

    def rotation_chunks(self, coords: torch.Tensor, layer: int) -> TokenRotations:
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
        (i + 0.5) / n0_a, n0_a the axis' divisor on the training grid, :meth:`axis_divisors`), which is what
        :func:`~visionpe.rotary.scaling.scale_frequencies` rescales (NTK's band index per axis, layer and head;
        YaRN's turns over the training grid). The eigenbasis comes from
        ``eigh(S^2)`` (S^2 = -S^T S has eigenvalues -omega_k^2), in fp64 and without gradient: as the frequency
        rules do for learned frequencies, the factor phi_a(S^2) is a constant of the backward, and gradients flow
        through S.
        """
        skew = self.layer_skew_blocks()
        with torch.no_grad():
            square = skew.detach().double()
            eigvals, basis = torch.linalg.eigh(square @ square)  # (L, h, m, b), columns of basis
            omega = (-eigvals).clamp_min(0).sqrt()  # each plane's frequency twice (and 0 for a fixed direction)
            cells = torch.tensor(self.axis_divisors(self.train_grid_size), dtype=torch.float64, device=skew.device)
            coeff = self.axis_coefficients().detach().double() / cells[:, None]  # (L | 1, ndim, m)
            freqs = coeff[:, None, :, :, None] * omega[:, :, None]  # (L, h, ndim, m, b)
            ratio = self.frequency_multipliers(freqs.flatten(-2), factors).view_as(freqs)
            # phi_a(S^2) = U diag(ratio) U^T, per axis
            phi = (basis.unsqueeze(2) * ratio.unsqueeze(-2)) @ basis.unsqueeze(2).transpose(-1, -2)
        out = skew.double().unsqueeze(2) @ phi  # (L, h, ndim, m, b, b)
        return ((out - out.transpose(-1, -2)) / 2).transpose(1, 2)  # skew to rounding; (L, ndim, h, m, b, b)
