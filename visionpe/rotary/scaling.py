"""Inference-time per-axis position scaling for rotary schemes.

Train on grid (H0, W0), test on (H, W): per-axis factors s_a = max(1, n_a / n0_a) (s_t too for video).

- PI, Chen et al., "Extending Context Window of Large Language Models via Positional Interpolation", 2023:
  p_a -> p_a / s_a, i.e. every frequency of axis a divided by s_a.
- NTK-aware (formalised in the YaRN paper): base b' = b * s^(D/(D-2)), i.e. theta_n -> theta_n * s^(-n/(n_a-1)).
  For a general (learned) spectrum the band index is read from the frequency itself, per axis, layer and head:
  rho = clamp(log(theta_max / theta) / log(theta_max / |f|_min), 0, 1), theta -> theta * s^-rho, where theta_max
  is the axis' fastest frequency and |f|_min the slowest rate of a pair that uses the axis (its rate over all
  axes). The highest band is kept, the lowest is divided by exactly s. With one axis per pair (axial RoPE) the
  rates are the frequencies themselves; when pairs mix axes (RoPE-Mixed), a component slower than every pair is
  interpolated fully, and a near-zero component (cos(pi/2) in fp32) cannot stretch the scale: RoPE-Mixed with
  its angles set to axial RoPE's gets axial RoPE's NTK rule.
- YaRN, Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models", ICLR 2024:
  r = L_a * theta / (2 pi) with L_a the training grid length, gamma = clamp((r - alpha) / (beta - alpha), 0, 1),
  theta' = (1 - gamma) theta / s_a + gamma theta, and cos/sin multiplied by 0.1 ln s + 1 (s = max_a s_a).

Every rotary scheme of visionpe mixes in :class:`Extrapolation`; :func:`set_extrapolation` switches the mode of
every rotary scheme of a model at evaluation time, without retraining.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from ..grid import validate_grid_size

__all__ = [
    "EXTRAPOLATION_MODES",
    "Extrapolation",
    "axis_scale_factors",
    "scale_frequencies",
    "yarn_attention_factor",
    "set_extrapolation",
]

EXTRAPOLATION_MODES = ("none", "pi", "ntk", "yarn")


def axis_scale_factors(grid_size: Sequence[int], train_grid_size: Sequence[int]) -> tuple[float, ...]:
    """Per-axis factors s_a = max(1, grid_size[a] / train_grid_size[a]); a factor <= 1 leaves the axis alone.

    Example:
        >>> axis_scale_factors((24, 14), (14, 14))
        (1.7142857142857142, 1.0)
    """
    grid_size = validate_grid_size(grid_size)
    train_grid_size = validate_grid_size(train_grid_size, "train_grid_size", ndims=(len(grid_size),))
    return tuple(max(1.0, n / n0) for n, n0 in zip(grid_size, train_grid_size, strict=True))


def yarn_attention_factor(factors: Sequence[float]) -> float:
    """YaRN's cos/sin multiplier 0.1 ln s + 1 with s = max_a s_a (1 when no axis is scaled)."""
    s = max(factors) if len(factors) else 1.0
    return 0.1 * math.log(s) + 1.0 if s > 1 else 1.0


def scale_frequencies(
    freqs: torch.Tensor,
    factors: Sequence[float],
    mode: str,
    train_grid_size: Sequence[int] | None = None,
    alpha: float = 1.0,
    beta: float = 32.0,
) -> torch.Tensor:
    """Scale the frequency matrix of a rotary scheme whose angle is linear in position.

    Args:
        freqs: (..., ndim, P) frequencies; row a holds the rate of every pair along coordinate axis a
            (zero where a pair ignores the axis; zeros stay zero).
        factors: ndim per-axis factors s_a (see :func:`axis_scale_factors`).
        mode: ``none``, ``pi``, ``ntk`` or ``yarn``.
        train_grid_size: training grid (ndim entries), needed by ``yarn`` for L_a.
        alpha, beta: YaRN ramp bounds on r = L_a * theta / (2 pi).

    Returns:
        (..., ndim, P) float32 tensor (float64 when ``freqs`` is float64).

    Example:
        >>> f = torch.tensor([[1.0, 0.1]])
        >>> scale_frequencies(f, (2.0,), "ntk")
        tensor([[1.0000, 0.0500]])
    """
    if mode not in EXTRAPOLATION_MODES:
        raise ValueError(f"mode must be one of {EXTRAPOLATION_MODES}, got {mode!r}")
    if not isinstance(freqs, torch.Tensor) or freqs.ndim < 2:
        raise ValueError(f"freqs must be a (..., ndim, P) tensor, got {getattr(freqs, 'shape', type(freqs))}")
    if len(factors) != freqs.shape[-2]:
        raise ValueError(f"factors must have ndim = {freqs.shape[-2]} entries, got {tuple(factors)}")
    if any(not s > 0 for s in factors):
        raise ValueError(f"factors must be positive, got {tuple(factors)}")
    if mode == "yarn":
        if train_grid_size is None or len(train_grid_size) != freqs.shape[-2]:
            raise ValueError(f"yarn needs train_grid_size with {freqs.shape[-2]} entries, got {train_grid_size}")
        if not beta > alpha:
            raise ValueError(f"yarn needs beta > alpha, got alpha={alpha}, beta={beta}")
    freqs = freqs if freqs.dtype == torch.float64 else freqs.float()
    if mode == "none" or all(s <= 1 for s in factors):
        return freqs
    rows = []
    rates = freqs.detach().norm(dim=-2)  # (..., P): each pair's rate over all axes, NTK's scale of bands
    for axis, s in enumerate(factors):
        f = freqs[..., axis, :]
        if s <= 1:
            rows.append(f)
            continue
        if mode == "pi":
            rows.append(f / s)
            continue
        mag = f.detach().abs()
        used = mag > 0
        if mode == "ntk":
            hi = torch.where(used, mag, torch.zeros_like(mag)).amax(-1, keepdim=True)
            lo = torch.where(used, rates, torch.full_like(rates, float("inf"))).amin(-1, keepdim=True)
            span = torch.log(hi / lo)
            # the band position in [0, 1]: 0 for the axis' fastest component, 1 at (or below) the slowest pair's rate
            rho = (torch.log(hi / mag.clamp_min(1e-30)) / span).clamp(0.0, 1.0)
            rho = torch.where(used & (span > 0), rho, torch.zeros_like(mag))
            rows.append(f * s ** (-rho))
        else:
            ratio = train_grid_size[axis] * mag / (2 * math.pi)
            gamma = ((ratio - alpha) / (beta - alpha)).clamp(0.0, 1.0)
            rows.append((1 - gamma) * f / s + gamma * f)
    return torch.stack(rows, dim=-2)


class Extrapolation(nn.Module):
    """Mixin holding a rotary scheme's extrapolation settings.

    ``supported_extrapolation`` lists the modes the scheme implements; the training grid comes from the model
    (``grid_size`` at construction) or from :meth:`set_extrapolation`.
    """

    supported_extrapolation: ClassVar[tuple[str, ...]] = EXTRAPOLATION_MODES

    def init_extrapolation(
        self,
        extrapolation: str = "none",
        grid_size: Sequence[int] | None = None,
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
    ) -> None:
        self.extrapolation = "none"
        self.train_grid_size = None if grid_size is None else validate_grid_size(grid_size)
        self.yarn_alpha, self.yarn_beta = 1.0, 32.0
        self.set_extrapolation(extrapolation, alpha=yarn_alpha, beta=yarn_beta)

    def set_extrapolation(
        self,
        mode: str,
        *,
        alpha: float | None = None,
        beta: float | None = None,
        train_grid_size: Sequence[int] | None = None,
    ) -> None:
        """Switch the scaling mode (``none``, ``pi``, ``ntk``, ``yarn``) at any time; nothing is retrained.

        Args:
            mode: scaling rule; the scheme's ``supported_extrapolation`` lists the modes it implements.
            alpha, beta: YaRN ramp bounds (kept when None).
            train_grid_size: override the training grid the factors are relative to.
        """
        if not isinstance(mode, str) or mode not in EXTRAPOLATION_MODES:
            raise ValueError(f"extrapolation must be one of {EXTRAPOLATION_MODES}, got {mode!r}")
        train = (
            self.train_grid_size
            if train_grid_size is None
            else validate_grid_size(train_grid_size, "train_grid_size", ndims=self._grid_ranks())
        )
        for arg, value in (("alpha", alpha), ("beta", beta)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"yarn {arg} must be a number, got {type(value).__name__} ({value!r})")
        alpha = self.yarn_alpha if alpha is None else float(alpha)
        beta = self.yarn_beta if beta is None else float(beta)
        reason = self.extrapolation_refusal(mode, train)
        if reason is not None:
            raise ValueError(reason)
        if not (math.isfinite(alpha) and math.isfinite(beta) and beta > alpha):
            raise ValueError(f"yarn_beta must be greater than yarn_alpha, got alpha={alpha}, beta={beta}")
        self.train_grid_size = train
        self.extrapolation, self.yarn_alpha, self.yarn_beta = mode, alpha, beta

    def _grid_ranks(self) -> tuple[int, ...]:
        """The grid ranks the scheme takes (its ``ndims``: exactly its ``ndim`` for the rotary schemes)."""
        return tuple(getattr(self, "ndims", (2, 3)))

    def extrapolation_refusal(self, mode: str, train_grid_size: tuple[int, ...] | None = None) -> str | None:
        """Why :meth:`set_extrapolation` would refuse ``mode`` in this configuration (with ``train_grid_size``,
        default the current training grid), or None: the one place every refusal is decided."""
        name = type(self).__name__
        ranks = self._grid_ranks()
        if train_grid_size is not None and len(train_grid_size) not in ranks:
            return (
                f"train_grid_size must have {' or '.join(map(str, ranks))} entries for {name}, "
                f"got {len(train_grid_size)}: {tuple(train_grid_size)}"
            )
        if mode not in self.supported_extrapolation:
            return (
                f"{name} supports extrapolation modes {self.supported_extrapolation}, got {mode!r}: "
                f"its rotation is not a set of frequencies that {mode} could rescale"
            )
        if mode == "none":
            return None
        if (train_grid_size or self.train_grid_size) is None:
            return (
                f"extrapolation={mode!r} needs the training grid: build {name} with grid_size=... "
                "(the model passes it) or call set_extrapolation(..., train_grid_size=...)"
            )
        if getattr(self, "coord_mode", "index") != "index" and not getattr(self, "_scales_own_coords", False):
            return (
                f"extrapolation={mode!r} rescales integer positions, but {name} uses "
                f"coord_mode={self.coord_mode!r}, which already interpolates"
            )
        return None

    def accepted_extrapolation(self) -> tuple[str, ...]:
        """The modes :meth:`set_extrapolation` accepts in this configuration."""
        return tuple(mode for mode in EXTRAPOLATION_MODES if self.extrapolation_refusal(mode) is None)

    def frequency_multipliers(self, freqs: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
        """(..., ndim, P) multiplier of each frequency under the current mode (:func:`scale_frequencies` over the
        frequency; 1 where a frequency is zero), without gradient: for schemes whose frequencies are read off
        learned generators (a constant of the backward, as for learned RoPE frequencies)."""
        with torch.no_grad():
            freqs = freqs.detach()
            scaled = scale_frequencies(
                freqs, factors, self.extrapolation, self.train_grid_size, self.yarn_alpha, self.yarn_beta
            )
            return torch.where(freqs != 0, scaled / torch.where(freqs != 0, freqs, 1.0), 1.0)

    def scale_factors(self, grid_size: Sequence[int] | None) -> tuple[float, ...] | None:
        """Per-axis factors for the current grid, or None when nothing is scaled."""
        if self.extrapolation == "none" or grid_size is None:
            return None
        if len(grid_size) != len(self.train_grid_size):
            raise ValueError(
                f"grid_size {tuple(grid_size)} and the training grid {self.train_grid_size} have different ranks"
            )
        factors = axis_scale_factors(grid_size, self.train_grid_size)
        return None if all(s <= 1 for s in factors) else factors


def set_extrapolation(
    model: nn.Module,
    mode: str,
    *,
    alpha: float | None = None,
    beta: float | None = None,
    train_grid_size: Sequence[int] | None = None,
) -> list[str]:
    """Switch the extrapolation mode of every rotary scheme in ``model``; returns the names switched.

    Example:
        >>> import timm, visionpe
        >>> m = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_axial", depth=1)
        >>> set_extrapolation(m, "ntk")
        ['pos_schemes.rope_axial']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, Extrapolation)]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no rotary scheme that supports extrapolation")
    if not isinstance(mode, str) or mode not in EXTRAPOLATION_MODES:
        raise ValueError(f"extrapolation must be one of {EXTRAPOLATION_MODES}, got {mode!r}")
    train = None if train_grid_size is None else validate_grid_size(train_grid_size, "train_grid_size")
    for name, module in targets:  # validate everything first: all switch or none
        reason = module.extrapolation_refusal(mode, train)
        if reason is not None:
            raise ValueError(f"{name or type(module).__name__}: {reason}")
    for _, module in targets:
        module.set_extrapolation(mode, alpha=alpha, beta=beta, train_grid_size=train_grid_size)
    return [name for name, _ in targets]
