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
- RIFLEx, Zhao et al., "RIFLEx: A Free Lunch for Length Extrapolation in Video Diffusion Transformers",
  arXiv 2502.15894, 2025 (thu-ml/RIFLEx): one band per axis, not a scale. With theta_j = b^(-2(j-1)/d) (j 1-based,
  fastest first) and periods N_j = round(2 pi / theta_j), the "intrinsic" band k is the one whose period is nearest
  the length N at which a video starts to repeat (:func:`identify_k`). At a test length L > N_k only that band
  changes, theta_k -> 0.9 * 2 pi / L, so that it stays within 90 % of one period over the L positions; every other
  band is untouched (:func:`riflex_frequencies`). It needs an axial spectrum (each rotary pair turns with one axis:
  ``axial_spectrum``, RoPE-Axial); k per axis is ``riflex_k``, by default [visionpe heuristic] the band whose period
  is nearest the training length n0_a.

Beside the modes, a scheme may hold a ``band_multiplier`` (a frequency multiplier per layer, head, axis and pair,
none by default) that :meth:`Extrapolation.adjust_frequencies` applies after the mode: DoPE's band removal
(:mod:`visionpe.rotary.dope`) sets it.

Every rotary scheme of visionpe mixes in :class:`Extrapolation`; :func:`set_extrapolation` switches the mode of
every rotary scheme of a model at evaluation time, without retraining.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from ..checks import check_float, check_int, is_int
from ..contract import UnsupportedSchemeError
from ..grid import validate_grid_size

__all__ = [
    "AXIS_NAMES",
    "DIFFUSION_MODES",
    "EXTRAPOLATION_MODES",
    "SCALING_MODES",
    "Extrapolation",
    "axis_scale_factors",
    "check_riflex_k",
    "identify_k",
    "riflex_frequencies",
    "scale_frequencies",
    "yarn_attention_factor",
    "set_extrapolation",
]

#: every evaluation-time mode: the per-axis scalings, then RIFLEx's single-band edit
EXTRAPOLATION_MODES = ("none", "pi", "ntk", "yarn", "riflex")
#: the modes that scale every frequency of an axis by its factor s_a: any set of frequencies takes them
SCALING_MODES = ("none", "pi", "ntk", "yarn")
#: modes that read the diffusion timestep, implemented by the rotary of a patched diffusion transformer only
#: (:mod:`visionpe.integrations.diffusers`): DyPE
DIFFUSION_MODES = ("dype",)
#: the coordinate axes' names by grid rank, the names ``set_extrapolation(..., axes=...)`` takes
AXIS_NAMES = {1: ("length",), 2: ("height", "width"), 3: ("time", "height", "width")}


def _check_grid_tensor(
    grid_size: torch.Tensor, name: str, ndim: int | None = None, what: str = "positions"
) -> torch.Tensor:
    # a grid (or its factors) given as a (ndim,) tensor, read on its device: its shape is checked here, its values
    # (taken from the input itself, e.g. the largest id + 1) are not read on the host
    if grid_size.ndim != 1 or grid_size.numel() == 0 or (ndim is not None and grid_size.numel() != ndim):
        expected = f"({ndim},)" if ndim is not None else "(ndim,)"
        raise ValueError(f"{name} must be a {expected} tensor of {what} per axis, got shape {tuple(grid_size.shape)}")
    if grid_size.is_complex() or grid_size.dtype == torch.bool:
        raise TypeError(f"{name} must be a real tensor of {what} per axis, got dtype {grid_size.dtype}")
    return grid_size


def axis_scale_factors(
    grid_size: Sequence[int] | torch.Tensor, train_grid_size: Sequence[int]
) -> tuple[float, ...] | torch.Tensor:
    """Per-axis factors s_a = max(1, grid_size[a] / train_grid_size[a]); a factor <= 1 leaves the axis alone.

    ``grid_size`` may be a (ndim,) tensor (the grid read off a model's position ids on their device): the factors
    are then a float64 tensor on that device, equal to the tuple the same grid as ints gives, and nothing is read
    on the host (no synchronisation; no graph break under ``torch.compile``).

    Example:
        >>> axis_scale_factors((24, 14), (14, 14))
        (1.7142857142857142, 1.0)
        >>> axis_scale_factors(torch.tensor([24, 14]), (14, 14))
        tensor([1.7143, 1.0000], dtype=torch.float64)
    """
    if isinstance(grid_size, torch.Tensor):
        grid_size = _check_grid_tensor(grid_size, "grid_size")
        train_grid_size = validate_grid_size(train_grid_size, "train_grid_size", ndims=(grid_size.numel(),))
        train = torch.tensor(train_grid_size, dtype=torch.float64, device=grid_size.device)
        return (grid_size.to(torch.float64) / train).clamp_min(1.0)
    grid_size = validate_grid_size(grid_size)
    train_grid_size = validate_grid_size(train_grid_size, "train_grid_size", ndims=(len(grid_size),))
    return tuple(max(1.0, n / n0) for n, n0 in zip(grid_size, train_grid_size, strict=True))


def yarn_attention_factor(factors: Sequence[float] | torch.Tensor) -> float | torch.Tensor:
    """YaRN's cos/sin multiplier 0.1 ln s + 1 with s = max_a s_a (1 when no axis is scaled); a 0-d tensor for
    factors given as a tensor (:func:`axis_scale_factors`)."""
    if isinstance(factors, torch.Tensor):
        s = factors.amax() if factors.numel() else factors.new_ones(())
        return torch.where(s > 1, 0.1 * torch.log(s) + 1.0, torch.ones_like(s))
    s = max(factors) if len(factors) else 1.0
    return 0.1 * math.log(s) + 1.0 if s > 1 else 1.0


def identify_k(base: float, dim: int, n: int) -> tuple[int, int]:
    """RIFLEx's intrinsic band of a RoPE axis: ``(k, N_k)``, the 1-based band whose period is nearest ``n``.

    theta_j = base^(-2(j-1)/dim) for j = 1..dim/2 and N_j = round(2 pi / theta_j) (Python's rounding, half to even);
    k = argmin_j |N_j - n|, the fastest band on a tie (RIFLEx's ``identify_k``).

    Args:
        base: the RoPE base b of the axis.
        dim: the axis' rotary channels d (2 per pair, so dim/2 bands; 2 n_t for RoPE-Axial's t axis).
        n: the length in positions at which the model repeats (the paper's N), or another reference length.

    Example:
        >>> identify_k(256, 16, 48)  # HunyuanVideo's time axis: periods 6, 13, 25, 50, 101, ...
        (4, 50)
    """
    check_float(base, "base", min=0, min_open=True, expected="a positive finite number")
    check_int(dim, "dim", min=2)
    if dim % 2:
        raise ValueError(f"dim must be even (2 channels per rotary pair), got {dim}")
    check_int(n, "n", min=1)
    thetas = [1.0 / float(base) ** (2 * (j - 1) / dim) for j in range(1, dim // 2 + 1)]
    periods = [round(2 * math.pi / theta) for theta in thetas]
    diffs = [abs(period - n) for period in periods]
    k = diffs.index(min(diffs)) + 1
    return k, periods[k - 1]


def check_riflex_k(riflex_k: int | Sequence[int | None] | None, ndim: int) -> tuple[int | None, ...]:
    """``riflex_k`` as one entry per coordinate axis ((y, x) or (t, y, x)): a 1-based band, 0 (leave the axis
    alone) or None (the band whose period is nearest the training length).

    None gives None on every axis; one int k >= 1 the same band on every axis; a sequence has ``ndim`` entries.

    Example:
        >>> check_riflex_k((4, 0, 0), 3), check_riflex_k(None, 2), check_riflex_k(3, 2)
        ((4, 0, 0), (None, None), (3, 3))
    """
    check_int(ndim, "ndim", min=1)
    if riflex_k is None:
        return (None,) * ndim
    if is_int(riflex_k):
        return (check_int(riflex_k, "riflex_k", min=1, expected="a band index >= 1 (1 = the fastest band)"),) * ndim
    if isinstance(riflex_k, torch.Tensor) or type(riflex_k).__module__ == "numpy":
        riflex_k = riflex_k.tolist()
    if not isinstance(riflex_k, (tuple, list)):
        raise TypeError(
            f"riflex_k must be None, an int >= 1 or a sequence of {ndim} entries (int >= 0 or None), "
            f"got {type(riflex_k).__name__} ({riflex_k!r})"
        )
    if len(riflex_k) != ndim:
        raise ValueError(
            f"riflex_k must have one entry per coordinate axis ({ndim}, in the order of grid_size), "
            f"got {len(riflex_k)}: {tuple(riflex_k)}"
        )
    expected = "None, 0 (axis left alone) or a band index >= 1"
    return tuple(
        None if k is None else check_int(k, f"riflex_k[{a}]", min=0, expected=expected) for a, k in enumerate(riflex_k)
    )


def riflex_frequencies(
    freqs: torch.Tensor,
    grid_size: Sequence[int] | torch.Tensor,
    train_grid_size: Sequence[int],
    riflex_k: int | Sequence[int | None] | None = None,
) -> torch.Tensor:
    """RIFLEx on an axial frequency matrix: per axis, only band k_a changes, and only on an axis longer than both its
    training length and N_k.

    Along axis a the pairs that read it are its bands, numbered 1, 2, ... from the fastest (RIFLEx's j), with
    periods N_j = round(2 pi / |theta_j|). k_a is ``riflex_k[a]`` or, for None, [visionpe heuristic] the band whose
    period is nearest the training length n0_a (the fastest on a tie). When L = ``grid_size[a]`` exceeds N_k,
    theta_k -> 0.9 * 2 pi / L (its sign kept); nothing else changes. [visionpe] An axis no longer than its training
    length is never edited, as no scaling mode edits it: in the paper's setting N_k is beyond the training length,
    where both rules agree; the heuristic can pick N_k below it.

    Args:
        freqs: (..., ndim, P) frequencies with at most one non-zero entry per pair (column): an axial spectrum.
        grid_size: the test grid (ndim entries); its lengths are RIFLEx's L_test. A (ndim,) tensor is read on its
            device (no host synchronisation; the checks that read the frequencies' values run outside
            ``torch.compile`` only).
        train_grid_size: the training grid (ndim entries).
        riflex_k: see :func:`check_riflex_k`; a given band must exist on its axis.

    Returns:
        (..., ndim, P) float32 tensor (float64 when ``freqs`` is float64); each (..., axis) row is edited on its own.

    Example:
        >>> f = torch.tensor([[1.0, 0.5, 0.25, 0.125]])  # one axis, periods 6, 13, 25, 50
        >>> riflex_frequencies(f, (30,), (20,))  # k = 3 (period 25, nearest 20): 0.9 * 2 pi / 30
        tensor([[1.0000, 0.5000, 0.1885, 0.1250]])
    """
    if not isinstance(freqs, torch.Tensor) or freqs.ndim < 2 or not freqs.is_floating_point():
        raise ValueError(
            f"freqs must be a floating-point (..., ndim, P) tensor, got {getattr(freqs, 'shape', type(freqs))}"
        )
    ndim = freqs.shape[-2]
    on_device = isinstance(grid_size, torch.Tensor)
    if on_device:
        grid_size = _check_grid_tensor(grid_size, "grid_size", ndim).to(torch.float64).unbind()
    else:
        grid_size = validate_grid_size(grid_size, ndims=(ndim,))
    train_grid_size = validate_grid_size(train_grid_size, "train_grid_size", ndims=(ndim,))
    ks = check_riflex_k(riflex_k, ndim)
    freqs = freqs if freqs.dtype == torch.float64 else freqs.float()
    checked = not torch.compiler.is_compiling()  # value checks are host reads: eager only
    if checked and bool(((freqs != 0).sum(-2) > 1).any()):
        raise ValueError(
            "riflex needs an axial spectrum (each rotary pair turning with one coordinate axis), but a pair of freqs "
            "has non-zero frequencies on several axes"
        )
    rows = list(freqs.unbind(-2))
    pairs = freqs.shape[-1]
    index = torch.arange(pairs, device=freqs.device)
    for axis, (n, n0, k) in enumerate(zip(grid_size, train_grid_size, ks, strict=True)):
        if k == 0 or (not on_device and n <= n0):
            continue
        f = rows[axis]
        mag = f.detach().double().abs()
        used = mag > 0
        # band number of each pair along the axis: 1 + the pairs of the axis that turn faster (ties: pair order)
        faster = (mag[..., None, :] > mag[..., :, None]) | (
            (mag[..., None, :] == mag[..., :, None]) & (index[None, :] < index[:, None])
        )
        band = 1 + (faster & used[..., None, :]).sum(-1)
        periods = torch.round(2 * math.pi / torch.where(used, mag, 1.0))
        if k is None:
            distance = torch.where(used, (periods - n0).abs(), math.inf)
            # nearest period first, then the fastest band (the lower band number)
            chosen = (distance * (pairs + 1) + band).argmin(-1, keepdim=True)
            selected = (index == chosen) & used
        else:
            bands = int(used.sum(-1).min()) if checked and used.numel() else k
            if k > bands:
                raise ValueError(f"riflex_k[{axis}] must be a band of axis {axis}, which has {bands} bands, got {k}")
            selected = used & (band == k)
        period_k = (periods * selected).sum(-1, keepdim=True)
        # an axis no longer than its training length is left alone (decided on the device for a tensor grid)
        edit = selected & (n > period_k) & (n > n0) if on_device else selected & (n > period_k)
        value = torch.sign(f) * (0.9 * 2 * math.pi / n)
        rows[axis] = torch.where(edit, value, f)
    return torch.stack(rows, dim=-2)


def scale_frequencies(
    freqs: torch.Tensor,
    factors: Sequence[float] | torch.Tensor,
    mode: str,
    train_grid_size: Sequence[int] | None = None,
    alpha: float = 1.0,
    beta: float = 32.0,
    *,
    riflex_k: int | Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Scale the frequency matrix of a rotary scheme whose angle is linear in position.

    Args:
        freqs: (..., ndim, P) frequencies; row a holds the rate of every pair along coordinate axis a
            (zero where a pair ignores the axis; zeros stay zero).
        factors: ndim per-axis factors s_a (see :func:`axis_scale_factors`): numbers, or a (ndim,) tensor of
            factors >= 1 computed on the device (an axis at 1 keeps its frequencies exactly; nothing is read on the
            host, so the scaling traces into a ``torch.compile`` graph).
        mode: one of :data:`EXTRAPOLATION_MODES`.
        train_grid_size: training grid (ndim entries), needed by ``yarn`` for L_a and by ``riflex`` (whose test
            lengths are s_a * n0_a).
        alpha, beta: YaRN ramp bounds on r = L_a * theta / (2 pi).
        riflex_k: RIFLEx's band per axis (:func:`check_riflex_k`); ``riflex`` only.

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
    on_device = isinstance(factors, torch.Tensor)
    if on_device:
        factors = _check_grid_tensor(factors, "factors", freqs.shape[-2], "scale factors")
    elif len(factors) != freqs.shape[-2]:
        raise ValueError(f"factors must have ndim = {freqs.shape[-2]} entries, got {tuple(factors)}")
    elif any(not s > 0 for s in factors):
        raise ValueError(f"factors must be positive, got {tuple(factors)}")
    if riflex_k is not None and mode != "riflex":
        raise ValueError(f"riflex_k applies to mode='riflex' only, got mode={mode!r} and riflex_k={riflex_k!r}")
    if mode in ("yarn", "riflex"):
        if train_grid_size is None or len(train_grid_size) != freqs.shape[-2]:
            raise ValueError(f"{mode} needs train_grid_size with {freqs.shape[-2]} entries, got {train_grid_size}")
        if not beta > alpha:
            raise ValueError(f"yarn needs beta > alpha, got alpha={alpha}, beta={beta}")
    freqs = freqs if freqs.dtype == torch.float64 else freqs.float()
    if mode == "none" or (not on_device and all(s <= 1 for s in factors)):
        return freqs
    if mode == "riflex":  # the test lengths are s_a * n0_a (the factors are their ratios to the training grid)
        if on_device:
            train = torch.tensor(train_grid_size, dtype=factors.dtype, device=factors.device)
            grid_size = torch.maximum(train, torch.round(factors * train))
        else:
            grid_size = tuple(max(n0, round(s * n0)) for s, n0 in zip(factors, train_grid_size, strict=True))
        return riflex_frequencies(freqs, grid_size, train_grid_size, riflex_k)
    rows = []
    rates = freqs.detach().norm(dim=-2)  # (..., P): each pair's rate over all axes, NTK's scale of bands
    for axis, s in enumerate(factors.unbind() if on_device else factors):
        f = freqs[..., axis, :]
        if not on_device and s <= 1:
            rows.append(f)
            continue
        if mode == "pi":
            scaled = f / s
        else:
            mag = f.detach().abs()
            used = mag > 0
            if mode == "ntk":
                hi = torch.where(used, mag, torch.zeros_like(mag)).amax(-1, keepdim=True)
                lo = torch.where(used, rates, torch.full_like(rates, float("inf"))).amin(-1, keepdim=True)
                span = torch.log(hi / lo)
                # the band position in [0, 1]: 0 for the axis' fastest component, 1 at (or below) the slowest rate
                rho = (torch.log(hi / mag.clamp_min(1e-30)) / span).clamp(0.0, 1.0)
                rho = torch.where(used & (span > 0), rho, torch.zeros_like(mag))
                scaled = f * s ** (-rho)
            else:
                ratio = train_grid_size[axis] * mag / (2 * math.pi)
                gamma = ((ratio - alpha) / (beta - alpha)).clamp(0.0, 1.0)
                scaled = (1 - gamma) * f / s + gamma * f
        # an axis at factor 1 keeps its frequencies exactly (decided on the device for tensor factors)
        rows.append(torch.where(s > 1, scaled, f) if on_device else scaled)
    return torch.stack(rows, dim=-2)


#: the options of :func:`set_extrapolation` each mode reads (``train_grid_size`` is read by every mode)
MODE_OPTIONS = {
    "yarn": ("alpha", "beta", "axes"),
    "riflex": ("riflex_k", "axes"),
    "dype": ("dype_method", "dype_exponent", "axes"),
    "pi": ("axes",),
    "ntk": ("axes",),
}


def check_mode_options(mode: str, **options: object) -> None:
    """:class:`~visionpe.contract.UnsupportedSchemeError` naming each option given (not None) that ``mode`` does not
    read (:data:`MODE_OPTIONS`): a setting that would change nothing is refused, not ignored.

    Example:
        >>> check_mode_options("yarn", alpha=0.5, riflex_k=None)
        >>> check_mode_options("pi", alpha=0.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        visionpe.contract.UnsupportedSchemeError: alpha applies to extrapolation='yarn' only, got ... and alpha=0.5
    """
    for name, value in options.items():
        if value is None or name in MODE_OPTIONS.get(mode, ()):
            continue
        readers = [m for m, names in MODE_OPTIONS.items() if name in names]
        where = f"extrapolation={readers[0]!r} only" if len(readers) == 1 else f"the modes {tuple(readers)}"
        raise UnsupportedSchemeError(f"{name} applies to {where}, got extrapolation={mode!r} and {name}={value!r}")


class Extrapolation(nn.Module):
    """Mixin holding a rotary scheme's extrapolation settings.

    ``supported_extrapolation`` lists the modes the scheme implements: the scaling modes, and ``riflex`` where the
    class declares ``axial_spectrum``; the training grid comes from the model (``grid_size`` at construction) or
    from :meth:`set_extrapolation`.
    """

    #: every rotary pair turns with one coordinate axis (one non-zero frequency per pair, in every layer and head),
    #: so that each axis has its own bands: what RIFLEx edits (RoPE-Axial)
    axial_spectrum: ClassVar[bool] = False

    @property
    def supported_extrapolation(self) -> tuple[str, ...]:
        """The scaling modes, and ``riflex`` for an ``axial_spectrum``."""
        return SCALING_MODES + (("riflex",) if self.axial_spectrum else ())

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
        self.riflex_k: tuple[int | None, ...] | None = None
        # the coordinate axes the mode applies to (indices into the grid), None: every axis
        self.extrapolation_axes: tuple[int, ...] | None = None
        self.mode_options: dict = {}
        # frequency multiplier (depth | 1, num_heads | 1, ndim, P) applied after the mode (DoPE), none by default;
        # not saved with the weights: it is an evaluation-time setting, like the mode
        self.register_buffer("band_multiplier", None, persistent=False)
        # the ramp bounds are options of the scheme whatever its mode (YaRN reads them once switched to it)
        self.yarn_alpha, self.yarn_beta = self._yarn_ramp(yarn_alpha, yarn_beta, ("yarn_alpha", "yarn_beta"))
        self.set_extrapolation(extrapolation)

    def set_extrapolation(
        self,
        mode: str,
        *,
        alpha: float | None = None,
        beta: float | None = None,
        train_grid_size: Sequence[int] | None = None,
        riflex_k: int | Sequence[int | None] | None = None,
        axes: Sequence[str] | None = None,
        **mode_options: object,
    ) -> None:
        """Switch the mode (one of :data:`EXTRAPOLATION_MODES`) at any time; nothing is retrained.

        Args:
            mode: scaling rule; the scheme's ``supported_extrapolation`` lists the modes it implements.
            alpha, beta: YaRN ramp bounds (kept when None): the scheme's settings, read whenever it runs ``"yarn"``
                (:func:`set_extrapolation` on a model takes them with ``"yarn"`` only).
            train_grid_size: override the training grid the factors are relative to (an int: the same on every axis).
            riflex_k: ``riflex`` only: RIFLEx's band per coordinate axis (:func:`check_riflex_k`; None: the band
                whose period is nearest the training length, on every axis).
            axes: the names of the coordinate axes the mode applies to (:meth:`axis_names`, e.g. ``("time",)``);
                None: every axis. The other axes keep their frequencies.
            mode_options: options of a mode the scheme adds (DyPE's ``dype_method`` and ``dype_exponent`` on a
                diffusion transformer's rotary); a scheme without such a mode refuses them.

        A mode the scheme does not implement raises :class:`~visionpe.contract.UnsupportedSchemeError` (a ValueError).
        """
        if not isinstance(mode, str) or mode not in EXTRAPOLATION_MODES + DIFFUSION_MODES:
            raise ValueError(f"extrapolation must be one of {EXTRAPOLATION_MODES + DIFFUSION_MODES}, got {mode!r}")
        train = (
            self.train_grid_size
            if train_grid_size is None
            else validate_grid_size(self._grid_of(train_grid_size), "train_grid_size", ndims=self._grid_ranks())
        )
        alpha, beta = self._yarn_ramp(alpha, beta)
        reason = self.extrapolation_refusal(mode, train)
        if reason is not None:
            raise UnsupportedSchemeError(reason)
        ks = self.check_riflex_options(mode, riflex_k, train)
        selected = self.check_axes(mode, axes, train)
        options = self.check_added_mode_options(mode, **mode_options)
        self.train_grid_size = train
        self.extrapolation, self.yarn_alpha, self.yarn_beta = mode, alpha, beta
        self.riflex_k = ks
        self.extrapolation_axes = selected
        self.mode_options = options

    def check_added_mode_options(self, mode: str, **options: object) -> dict:
        """The options of a mode the scheme adds to :data:`EXTRAPOLATION_MODES`, validated (none here: any option
        is refused, as a setting that would change nothing); kept as ``mode_options`` by :meth:`set_extrapolation`."""
        if options:
            raise UnsupportedSchemeError(
                f"{type(self).__name__} takes no option {sorted(options)} for extrapolation={mode!r}"
            )
        return {}

    def axis_names(self, train_grid_size: Sequence[int] | None = None) -> tuple[str, ...]:
        """The names of the coordinate axes, in grid order (:data:`AXIS_NAMES` by the grid's rank)."""
        train = train_grid_size or self.train_grid_size
        rank = len(train) if train is not None else self._grid_ranks()[0]
        return AXIS_NAMES.get(rank, tuple(f"axis{a}" for a in range(rank)))

    def check_axes(
        self, mode: str, axes: Sequence[str] | None, train_grid_size: Sequence[int] | None = None
    ) -> tuple[int, ...] | None:
        """``axes`` (names, see :meth:`axis_names`) as grid indices, None for every axis; a ValueError names an
        axis the scheme does not have, a repeated one, or ``axes`` with ``mode="none"``."""
        if axes is None:
            return None
        if mode == "none":
            raise ValueError(f"axes applies to an extrapolation mode other than 'none', got axes={axes!r}")
        if isinstance(axes, str) or not isinstance(axes, (tuple, list)) or not axes:
            raise TypeError(f"axes must be a non-empty sequence of axis names, got {type(axes).__name__} ({axes!r})")
        names = self.axis_names(train_grid_size)
        unknown = [a for a in axes if a not in names]
        if unknown:
            raise ValueError(
                f"axes must name axes of {type(self).__name__}, which has {names}, got {tuple(axes)} "
                f"({', '.join(map(repr, unknown))} not among them)"
            )
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes must not repeat an axis, got {tuple(axes)}")
        return tuple(sorted(names.index(a) for a in axes))

    def _yarn_ramp(
        self, alpha: float | None, beta: float | None, names: tuple[str, str] = ("alpha", "beta")
    ) -> tuple[float, float]:
        """YaRN's ramp bounds (alpha, beta): the current ones where None; TypeError (naming the argument, ``names``)
        for a non-number, ValueError unless both are finite and beta > alpha."""
        for arg, value in zip(names, (alpha, beta), strict=True):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{arg} must be a number (YaRN's ramp bound), got {type(value).__name__} ({value!r})")
        alpha = self.yarn_alpha if alpha is None else float(alpha)
        beta = self.yarn_beta if beta is None else float(beta)
        if not (math.isfinite(alpha) and math.isfinite(beta) and beta > alpha):
            raise ValueError(f"yarn_beta must be greater than yarn_alpha, got alpha={alpha}, beta={beta}")
        return alpha, beta

    def _grid_of(self, size: int | Sequence[int]) -> Sequence[int]:
        """``size`` as a grid: an int is the same size on every axis of the scheme's grid (its training grid's rank,
        else the first rank it takes), as ``img_size=224`` is for timm."""
        if not is_int(size):
            return size
        rank = len(self.train_grid_size) if self.train_grid_size is not None else self._grid_ranks()[0]
        return (size,) * rank

    def check_riflex_options(
        self,
        mode: str,
        riflex_k: int | Sequence[int | None] | None,
        train_grid_size: tuple[int, ...] | None = None,
    ) -> tuple[int | None, ...] | None:
        """``riflex_k`` per axis for ``mode`` (None for the other modes, which take no ``riflex_k``); ValueError for
        a band the axis does not have (read off the scheme's frequencies)."""
        if mode != "riflex":
            if riflex_k is not None:
                raise ValueError(
                    f"riflex_k applies to extrapolation='riflex' only, got {mode!r} and riflex_k={riflex_k!r}"
                )
            return None
        train = train_grid_size or self.train_grid_size
        ks = check_riflex_k(riflex_k, len(train) if train is not None else self._grid_ranks()[0])
        if any(k for k in ks) and callable(getattr(self, "frequencies", None)):
            with torch.no_grad():
                freqs = self.frequencies()  # (..., ndim, P): count the bands of each axis in every layer and head
                bands = (freqs != 0).sum(-1).reshape(-1, freqs.shape[-2]).amin(0).tolist()
            for axis, (k, count) in enumerate(zip(ks, bands, strict=True)):
                if k and k > count:
                    raise ValueError(
                        f"riflex_k[{axis}] must be a band of axis {axis}, which has {count} bands in "
                        f"{type(self).__name__}, got {k}"
                    )
        return ks

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
        if mode == "riflex" and mode not in self.supported_extrapolation:
            return (
                f"{name} supports extrapolation modes {self.supported_extrapolation}, got 'riflex': RIFLEx edits one "
                "band per axis and needs an axial spectrum (each rotary pair turning with one axis, as RoPE-Axial)"
            )
        if mode in DIFFUSION_MODES and mode not in self.supported_extrapolation:
            return (
                f"{name} supports extrapolation modes {self.supported_extrapolation}, got {mode!r}: it schedules the "
                "extrapolation over the diffusion timestep, a mode of the rotary of a diffusion transformer patched "
                "by visionpe.integrations.diffusers"
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
        """The modes :meth:`set_extrapolation` accepts in this configuration (DyPE on a diffusion rotary only)."""
        modes = EXTRAPOLATION_MODES + DIFFUSION_MODES
        return tuple(mode for mode in modes if self.extrapolation_refusal(mode) is None)

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

    def scale_factors(self, grid_size: Sequence[int] | torch.Tensor | None) -> tuple[float, ...] | torch.Tensor | None:
        """Per-axis factors for the current grid, or None when nothing is scaled; for a grid given as a (ndim,)
        tensor, a float64 tensor on its device (never None: whether an axis is scaled is decided there)."""
        if self.extrapolation == "none" or grid_size is None:
            return None
        if len(grid_size) != len(self.train_grid_size):
            shown = tuple(grid_size.shape) if isinstance(grid_size, torch.Tensor) else tuple(grid_size)
            raise ValueError(f"grid_size {shown} and the training grid {self.train_grid_size} have different ranks")
        factors = axis_scale_factors(grid_size, self.train_grid_size)
        selected = getattr(self, "extrapolation_axes", None)
        if isinstance(factors, torch.Tensor):
            if selected is not None:
                keep = torch.tensor([a in selected for a in range(len(factors))], device=factors.device)
                factors = torch.where(keep, factors, torch.ones_like(factors))
            return factors
        if selected is not None:
            factors = tuple(s if a in selected else 1.0 for a, s in enumerate(factors))
        return None if all(s <= 1 for s in factors) else factors

    def adjust_frequencies(
        self, freqs: torch.Tensor, grid_size: Sequence[int] | torch.Tensor | None
    ) -> tuple[torch.Tensor, float | torch.Tensor]:
        """``freqs`` (..., ndim, P) for ``grid_size``: scaled by the mode (:func:`scale_frequencies`; RIFLEx's band
        edit), then times ``band_multiplier`` when one is set; and YaRN's cos/sin multiplier (1 otherwise; a 0-d
        tensor for a grid given as a tensor, which is read on its device).

        ``freqs`` comes back as it is when neither applies (same tensor, gradient and dtype).
        """
        factors = self.scale_factors(grid_size)
        mscale = 1.0
        if factors is not None:
            freqs = scale_frequencies(
                freqs,
                factors,
                self.extrapolation,
                self.train_grid_size,
                self.yarn_alpha,
                self.yarn_beta,
                riflex_k=self.riflex_k,
            )
            mscale = yarn_attention_factor(factors) if self.extrapolation == "yarn" else 1.0
        multiplier = self.band_multiplier
        if multiplier is not None:
            freqs = freqs * multiplier
        return freqs, mscale


def set_extrapolation(
    model: nn.Module,
    mode: str,
    *,
    alpha: float | None = None,
    beta: float | None = None,
    train_grid_size: Sequence[int] | None = None,
    riflex_k: int | Sequence[int | None] | None = None,
    axes: Sequence[str] | None = None,
    dype_method: str | None = None,
    dype_exponent: float | None = None,
) -> list[str]:
    """Switch the extrapolation mode of every rotary scheme in ``model``; returns the names switched.

    ``alpha``, ``beta`` (``mode="yarn"`` only): YaRN's ramp bounds. ``riflex_k`` (``mode="riflex"`` only): RIFLEx's
    band per coordinate axis, see :func:`check_riflex_k`. ``train_grid_size``: the training grid the factors are
    relative to (an int: the same on every axis). ``axes``: the names of the coordinate axes the mode applies to
    (``("height", "width")``, ``("time",)``; None: every axis), the others keep their frequencies. ``dype_method``
    and ``dype_exponent`` (``mode="dype"`` only, a diffusion transformer patched by
    :func:`visionpe.integrations.diffusers.apply_position_scheme`): DyPE's base method (``"yarn"`` or ``"ntk"``)
    and its schedule's exponent (lambda_t). An option the mode does not read, a model without a scheme that
    extrapolates, or a mode one of its schemes does not implement raises
    :class:`~visionpe.contract.UnsupportedSchemeError` (a ValueError), and nothing is switched.

    Example:
        >>> import timm, visionpe
        >>> m = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_axial", depth=1)
        >>> set_extrapolation(m, "ntk")
        ['pos_schemes.rope_axial']
        >>> set_extrapolation(m, "riflex", riflex_k=(0, 3))  # band 3 of x only
        ['pos_schemes.rope_axial']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, Extrapolation)]
    if not targets:
        raise UnsupportedSchemeError(
            f"{type(model).__name__} has no rotary scheme with extrapolation modes (the rotary schemes of "
            "visionpe.list_schemes('rotary') but SeqPE), so set_extrapolation would change nothing"
        )
    if not isinstance(mode, str) or mode not in EXTRAPOLATION_MODES + DIFFUSION_MODES:
        raise ValueError(f"extrapolation must be one of {EXTRAPOLATION_MODES + DIFFUSION_MODES}, got {mode!r}")
    check_mode_options(
        mode, alpha=alpha, beta=beta, riflex_k=riflex_k, axes=axes, dype_method=dype_method, dype_exponent=dype_exponent
    )
    mode_options = {k: v for k, v in (("dype_method", dype_method), ("dype_exponent", dype_exponent)) if v is not None}
    if is_int(train_grid_size):
        check_int(train_grid_size, "train_grid_size", min=1)
    elif train_grid_size is not None:
        validate_grid_size(train_grid_size, "train_grid_size")
    for name, module in targets:  # validate everything first: all switch or none
        train = None if train_grid_size is None else validate_grid_size(module._grid_of(train_grid_size))
        reason = module.extrapolation_refusal(mode, train)
        if reason is not None:
            raise UnsupportedSchemeError(f"{name or type(module).__name__}: {reason}")
        module.check_riflex_options(mode, riflex_k, train)
        module.check_axes(mode, axes, train or module.train_grid_size)
        module.check_added_mode_options(mode, **mode_options)
    for _, module in targets:
        module.set_extrapolation(
            mode,
            alpha=alpha,
            beta=beta,
            train_grid_size=train_grid_size,
            riflex_k=riflex_k,
            axes=axes,
            **mode_options,
        )
    return [name for name, _ in targets]
