"""GridPE: Li, Wu, Huang, Zhang, "GridPE: Unifying Positional Encoding in Transformers with a Grid Cell-Inspired
Framework", arXiv 2406.07049, 2024 (code: BoyangL1/gridpe-vision).

The paper models a position code on grid cells: g(p) = sum_m c_m exp(i omega_m . p), where at each scale (a grid
"module") the wave vectors omega_m point to the n + 1 vertices of a regular simplex in n dimensions (three
directions 120 degrees apart in 2D), and the scales form a geometric series whose optimal ratio, from an argument
on neuron economy, is sqrt(e) in 2D.

The library implements that construction as fixed frequencies of a rotary scheme (RoPE-Mixed with fixed
frequencies; the library's reading): the head's rotary pairs are grouped into modules of n + 1 pairs, and pair m
of module k turns by omega_k u_{k,m} . p, with

- u_{k,m} the simplex directions of module k: in 2D at angles phi_k + 2 pi m / 3 from the x axis; in 3D the four
  vertex directions of a regular tetrahedron turned by a random rotation Q_k [reading]. phi_k (or Q_k) is drawn
  once, from a generator seeded by ``seed``, and stored in the ``directions`` buffer (saved in checkpoints);
- omega_k = omega0 * r^-k, omega0 = 1 rad per patch for the fastest module, r = sqrt(e) in 2D and e^(1/3) in 3D
  (e^(1/n) in n dimensions [reading]);
- pairs left over after the last whole module get frequency 0 (they pass unrotated).

Every pair is a rotation whose angle is linear in position, so the scheme is exactly relative, and PI, NTK and
YaRN scale its frequencies as RoPE-Mixed's. Nothing is learned.

The released code (``gridPE/gridPE.py`` ``GridRotatePositionalEncoding``, ``Twins_gridPE/gvt.py``) differs from the
paper, and the library does not follow it: for pair k it multiplies (x_1 + i x_2) by g_k(p) =
sum_m c_m exp(i omega_{k,m} . p), with c the column sums of a stored matrix, so |g_k| != 1 (not a rotation) and the
cross terms between the three waves make q . k depend on absolute positions (not relative); the phases phi_k are
redrawn with NumPy at every forward, separately for q and k; the magnitude is 200^(k/d), i.e. a ratio of 200^(1/d)
between pairs instead of sqrt(e) between modules; and with a cls token the positions are laid out on a grid one row
taller and cut to the sequence length, which shifts every patch's position by one token.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..checks import check_float, check_int
from ..registry import register_scheme
from .base import LinearRotary

__all__ = ["GridPE", "simplex_directions", "default_ratio"]


def default_ratio(ndim: int) -> float:
    """The scale ratio between consecutive modules: e^(1/ndim) (sqrt(e) in 2D, the paper's; e^(1/3) in 3D, the
    library's reading of its n-dimensional argument).

    Example:
        >>> round(default_ratio(2), 6)
        1.648721
    """
    if ndim not in (2, 3):
        raise ValueError(f"ndim must be 2 or 3, got {ndim!r}")
    return math.exp(1.0 / ndim)


def _random_rotations(count: int, generator: torch.Generator) -> torch.Tensor:
    """(count, 3, 3) rotations drawn uniformly (QR of a Gaussian matrix, signs fixed, determinant +1), float64."""
    gauss = torch.randn(count, 3, 3, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar measure on O(3)
    flip = torch.linalg.det(q) < 0
    q[flip, :, 0] = -q[flip, :, 0]  # into SO(3)
    return q


def simplex_directions(num_modules: int, ndim: int, seed: int = 0) -> torch.Tensor:
    """(num_modules, ndim + 1, ndim) unit wave directions, columns in coordinate order ((y, x) or (t, y, x)).

    2D: module k has the directions at angles phi_k + 2 pi m / 3 from the x axis (m = 0, 1, 2), phi_k ~ U[0, 2 pi);
    3D: the vertices of a regular tetrahedron, (1, 1, 1), (1, -1, -1), (-1, 1, -1), (-1, -1, 1) / sqrt(3) in
    (x, y, t), turned by a uniformly random rotation per module. The draws come from a generator seeded by ``seed``,
    so the same seed gives the same directions. The directions of each module sum to 0.

    Example:
        >>> simplex_directions(2, 2).sum(1).abs().max() < 1e-6
        tensor(True)
    """
    check_int(num_modules, "num_modules", min=1)
    if ndim not in (2, 3):
        raise ValueError(f"ndim must be 2 or 3, got {ndim!r}")
    check_int(seed, "seed", min=0)
    generator = torch.Generator().manual_seed(seed)
    if ndim == 2:
        phases = torch.rand(num_modules, 1, generator=generator, dtype=torch.float64) * 2 * math.pi
        angles = phases + 2 * math.pi * torch.arange(3, dtype=torch.float64) / 3
        directions = torch.stack((angles.cos(), angles.sin()), dim=-1)  # (x, y)
    else:
        vertices = torch.tensor([[1, 1, 1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1]], dtype=torch.float64) / math.sqrt(3)
        directions = vertices @ _random_rotations(num_modules, generator).transpose(-1, -2)  # (x, y, t)
    return directions.flip(-1).float()  # coordinate order: (y, x) or (t, y, x)


@register_scheme("gridpe")
class GridPE(LinearRotary):
    """Grid-cell rotary frequencies: modules of ndim + 1 pairs along simplex directions, geometric scales.

    Args:
        dim, num_heads, depth: model shape (the frequencies are shared by every block and head).
        omega0: magnitude of the fastest module, radians per unit of the coordinates (1 rad per patch).
        ratio: scale ratio r > 1 between consecutive modules (omega_k = omega0 * r^-k); None: e^(1/ndim), sqrt(e)
            in 2D as the paper, e^(1/3) in 3D [reading].
        seed: seed of the generator that draws each module's orientation once (kept in the ``directions`` buffer).
        ndim: 2 for images (y, x), 3 for video (t, y, x).
        coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta, rotate_values: the shared rotary options, by
            keyword (:class:`~visionpe.rotary.base.RotaryOptions`: integer patch positions, no extrapolation).

    head_dim // 2 pairs give (head_dim // 2) // (ndim + 1) modules; the remaining pairs have frequency 0.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        omega0: float = 1.0,
        ratio: float | None = None,
        seed: int = 0,
        ndim: int = 2,
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, options=self.rotary_options(options))
        self.omega0 = check_float(omega0, "omega0", min=0, min_open=True)
        if ratio is None:
            ratio = default_ratio(ndim)
        self.ratio = check_float(ratio, "ratio", min=1, min_open=True, expected="a finite number > 1 or None")
        self.seed = check_int(seed, "seed", min=0)
        pairs, per_module = self.head_dim // 2, ndim + 1
        self.num_modules = pairs // per_module
        if self.num_modules < 1:
            raise ValueError(
                f"head_dim must give at least one module of ndim + 1 = {per_module} rotary pairs, got "
                f"head_dim={self.head_dim} ({pairs} pairs)"
            )
        self.register_buffer("directions", simplex_directions(self.num_modules, ndim, self.seed))

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # persistent: the drawn directions are state a checkpoint keeps, whatever a later torch's generator draws
        return {"directions": simplex_directions(self.num_modules, self.ndim, self.seed)}

    def magnitudes(self) -> torch.Tensor:
        """(num_modules,) omega_k = omega0 * ratio^-k, float64."""
        k = torch.arange(self.num_modules, dtype=torch.float64)
        return self.omega0 * self.ratio**-k

    def frequencies(self) -> torch.Tensor:
        with torch.autocast(self.directions.device.type, enabled=False):
            waves = self.directions.float() * self.magnitudes().float().to(self.directions.device)[:, None, None]
            used = waves.flatten(0, 1).T  # (ndim, num_modules * (ndim + 1)): pair m of module k
            freqs = used.new_zeros(self.ndim, self.head_dim // 2)
            freqs[:, : used.shape[1]] = used
        return freqs[None, None]

    def _apply(self, fn, *args, **kwargs):
        directions = self.directions
        module = super()._apply(fn, *args, **kwargs)
        # model.to(bfloat16) casts every floating buffer: the drawn directions are kept in fp32 (their bf16 rounding
        # would break the simplex and, with angles growing with position, cost ~0.1 rad at x = 63)
        if self.directions.is_floating_point() and torch.finfo(self.directions.dtype).bits < 32:
            self.directions = directions.to(device=self.directions.device)
        return module
