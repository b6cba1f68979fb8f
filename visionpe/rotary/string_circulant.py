"""Circulant-STRING: Schenck et al., "Learning the RoPEs: Better 2D and 3D Position Encodings with STRING", ICML 2025.

R(r) = exp(sum_k r_k L_k), L_k = C_k - C_k^T with C_k circulant (first column c_k in R^d), applied as
z' = Re IFFT(exp(sum_k r_k mu_k) * FFT(z)), mu_k = FFT(c_k) - conj(FFT(c_k)) = 2i Im FFT(c_k): in the real
Fourier basis F (rows: DC, Nyquist, then Re and Im of bins 1..d/2-1) R(r) = F^T RoPE(phi(r)) F with
phi_m(r) = sum_k 2 r_k Im FFT(c_k)_m. The scheme runs that form: one d x d product and RoPE, exactly relative.

``apply`` (used in attention) returns RoPE(phi) F z = F R(r) z: attention scores are exactly those of R(r), and
F, like Cayley-STRING's P, folds into W_q, W_k (:func:`~visionpe.rotary.string_base.fold_string_`).
``rotate`` returns R(r) z itself; :func:`circulant_string_fft` is the FFT form of the paper.
Init of c_k is not published [visionpe]: the spectrum of axial RoPE (base 100), the bins split between axes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..base import check_rotate_input
from ..registry import register_scheme
from .frequencies import axial_frequencies, check_base
from .string_base import StringBase

__all__ = ["StringCirculant", "fourier_basis", "circulant_string_fft", "circulant_generator"]


def fourier_basis(head_dim: int) -> torch.Tensor:
    """(d, d) orthogonal real DFT basis: rows DC, Nyquist, then (Re, Im) of bins m = 1..d/2-1 (rfft sign).

    Example:
        >>> f = fourier_basis(4)
        >>> torch.allclose(f @ f.T, torch.eye(4), atol=1e-6)
        True
    """
    if head_dim % 2 or head_dim < 2:
        raise ValueError(f"head_dim must be even and >= 2, got {head_dim}")
    n = torch.arange(head_dim, dtype=torch.float64)
    rows = [torch.full((head_dim,), 1 / math.sqrt(head_dim), dtype=torch.float64), (-1.0) ** n / math.sqrt(head_dim)]
    for m in range(1, head_dim // 2):
        angle = 2 * math.pi * m * n / head_dim
        rows += [angle.cos() * math.sqrt(2 / head_dim), -angle.sin() * math.sqrt(2 / head_dim)]
    return torch.stack(rows).float()


def _phase_rates(c: torch.Tensor) -> torch.Tensor:
    """(..., d) first columns -> (..., d/2 + 1) phase rates 2 Im FFT(c)_m (zero at DC and Nyquist)."""
    with torch.autocast(c.device.type, enabled=False):
        return 2 * torch.fft.rfft(c.float(), dim=-1).imag


def circulant_generator(c: torch.Tensor) -> torch.Tensor:
    """Dense L = C - C^T with C[i, j] = c[(i - j) mod d], for tests and reference: (..., d) -> (..., d, d)."""
    d = c.shape[-1]
    idx = (torch.arange(d).unsqueeze(1) - torch.arange(d).unsqueeze(0)) % d
    circ = c[..., idx]
    return circ - circ.transpose(-1, -2)


def circulant_string_fft(z: torch.Tensor, coords: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The paper's O(d log d) apply: z' = Re IFFT(exp(sum_k r_k mu_k) * FFT(z)).

    Args:
        z: (..., N, d) vectors, N tokens.
        coords: (N, ndim) positions r.
        c: (..., ndim, d) first columns c_k of the circulant matrices (broadcast against z's leading dims).

    Returns:
        (..., N, d) rotated vectors, z's dtype (computed in fp32).
    """
    if coords.ndim != 2 or c.shape[-2] != coords.shape[1] or c.shape[-1] != z.shape[-1]:
        raise ValueError(
            f"coords (N, ndim), c (..., ndim, d) and z (..., N, d) disagree: {tuple(coords.shape)}, "
            f"{tuple(c.shape)}, {tuple(z.shape)}"
        )
    with torch.autocast(z.device.type, enabled=False):
        phase = coords.float() @ _phase_rates(c)  # (..., N, d/2 + 1)
        spectrum = torch.fft.rfft(z.float(), dim=-1) * torch.polar(torch.ones_like(phase), phase)
        return torch.fft.irfft(spectrum, n=z.shape[-1], dim=-1).to(z.dtype)


@register_scheme("string_circulant")
class StringCirculant(StringBase):
    """Circulant-STRING for 2D (y, x) or 3D coordinates; c_k learned per layer and head.

    Args:
        dim, num_heads, depth: model shape.
        base: base of the axial spectrum c_k starts from.
        ndim: 2 for images, 3 for (t, y, x) video or (z, y, x) RGB-D positions passed to ``rotate``.
        depth_coords: RGB-D positions (z, y, x) on a 2D image grid, as
            :class:`~visionpe.rotary.string_cayley.StringCayley`.
        coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta, rotate_values: the shared rotary options, by
            keyword (:class:`~visionpe.rotary.base.RotaryOptions`); the extrapolation modes scale phi,
            ``rotate_values`` maps v_j -> R(r_j) v_j and o_i -> R(r_i)^T o_i (:mod:`visionpe.rotary.string_base`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 100.0,
        ndim: int = 2,
        depth_coords: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, depth_coords, self.rotary_options(options))
        ndim = self.ndim  # 3 with depth_coords: (z, y, x)
        check_base(base)
        bins = self.head_dim // 2 - 1  # rotating bins 1..d/2-1; DC and Nyquist are real and stay fixed
        if bins < ndim:
            raise ValueError(
                f"head_dim must be >= {2 * ndim + 2} for ndim={ndim} (a rotating Fourier bin per axis), "
                f"got head_dim={self.head_dim}"
            )
        per_axis = [bins // ndim + (a < bins % ndim) for a in range(ndim)]
        rates = axial_frequencies(2 * bins, base, per_axis)  # (ndim, bins), rows in coord order
        spectrum = torch.zeros(ndim, self.head_dim // 2 + 1, dtype=torch.complex64)
        spectrum[:, 1:-1] = 1j * rates / 2  # 2 Im FFT(c) = rate
        c = torch.fft.irfft(spectrum, n=self.head_dim, dim=-1)
        self.first_columns = nn.Parameter(c.expand(depth, num_heads, ndim, self.head_dim).clone())
        self.register_buffer("basis", fourier_basis(self.head_dim), persistent=False)
        self.base = float(base)

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        return {**super().fixed_buffers(), "basis": fourier_basis(self.head_dim)}

    def frequencies(self) -> torch.Tensor:
        rates = _phase_rates(self.first_columns)  # (depth, heads, ndim, d/2 + 1)
        # pair 0 holds (DC, Nyquist), which never rotate; pair m holds (Re, Im) of bin m
        return torch.cat((torch.zeros_like(rates[..., :1]), rates[..., 1:-1]), dim=-1)

    def string_basis(self) -> torch.Tensor:
        return self.basis[None, None]

    def rotation_output_basis(self) -> torch.Tensor:
        return self.basis

    def rotate_fft(
        self, x: torch.Tensor, coords: torch.Tensor, layer: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """R(r) x by the FFT form, (B, num_heads, N, head_dim) -> same (equals ``rotate``).

        The FFT form has no extrapolation scaling: when the extrapolation mode would scale ``grid_size`` (or the
        grid read off ``index`` coordinates, as ``rotate`` does) it raises ValueError; use ``rotate`` then.
        """
        coords = check_rotate_input(self, x, coords, layer)
        if self.scale_factors(self.rotation_grid_size(coords, grid_size)) is not None:
            raise ValueError(
                f"rotate_fft computes the unscaled rotation, but extrapolation={self.extrapolation!r} scales this "
                f"grid against the training grid {self.train_grid_size}: use rotate(x, coords, layer, grid_size)"
            )
        c = self.first_columns[layer] if self.first_columns.shape[0] > 1 else self.first_columns[0]
        return circulant_string_fft(x, coords, c)

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"first_columns"}
