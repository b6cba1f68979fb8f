"""The axial rotary of a diffusion transformer, expressed in visionpe: its axes, their channels and bases, and every
extrapolation mode on top of them, DyPE's timestep schedule included.

The image and video DiTs of diffusers (Flux, Qwen-Image, Wan, HunyuanVideo, CogVideoX) share one rotary: the head's
channels are cut into one block per coordinate axis (Flux: index, height, width with 16, 56, 56 channels), block a
rotates its pairs with the frequencies theta_a^(-2j/d_a), j < d_a / 2, times the token's position on that axis, and
the pairs are interleaved channels (2j, 2j + 1). :class:`DiffusionRotary` holds those axes and computes the
per-token cos and sin as the models do (in their frequency dtype: float64 where they use it), so a patched model
equals the original to float rounding; its mode (``visionpe.set_extrapolation`` on the patched transformer) edits
the frequencies of the axes it names.

DyPE (Issachar, Yariv, Benaim, Adi, Lischinski, Fattal, "DyPE: Dynamic Position Extrapolation for Ultra High
Resolution Diffusion", arXiv 2510.20766, 2025) schedules an extrapolation over the diffusion timestep t in [0, 1]
(1: pure noise): at t = 1 the full extrapolation, towards t = 0 the model's own frequencies for ever more bands
(:func:`dype_frequencies`, as its released code computes it for Flux).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...checks import check_choice, check_float, check_int
from ...contract import UnsupportedSchemeError
from ...grid import validate_grid_size
from ...rotary.scaling import SCALING_MODES, Extrapolation

__all__ = ["DYPE_METHODS", "DiffusionRotary", "dype_frequencies", "rope_frequencies"]

#: DyPE's base methods: YaRN's two ramps (the paper's DY-YaRN) or an NTK base (DY-NTK)
DYPE_METHODS = ("yarn", "ntk")


def rope_frequencies(dim: int, theta: float, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The (dim / 2,) frequencies 1 / theta^(2j / dim) of one axis, computed as diffusers computes them (the power
    in ``dtype``, then its reciprocal)."""
    check_int(dim, "dim", min=2)
    if dim % 2:
        raise ValueError(f"dim must be even (2 channels per rotary pair), got {dim}")
    check_float(theta, "theta", min=0, min_open=True, expected="a positive finite number")
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device)[: dim // 2] / dim))


def _correction_range(
    low_ratio: torch.Tensor, high_ratio: torch.Tensor, dim: int, theta: float, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # the band index at which a band turns `ratio` times over `length` positions (YaRN's inverse-dim formula),
    # floored (low) and ceiled (high), clamped to [0, dim / 2]
    def band(ratio: torch.Tensor) -> torch.Tensor:
        return dim * torch.log(length / (ratio * 2 * math.pi)) / (2 * math.log(theta))

    low = torch.floor(band(low_ratio)).clamp(min=0)
    high = torch.ceil(band(high_ratio)).clamp(max=dim - 1).clamp(max=dim // 2)
    return low, high


def _ramp(low: torch.Tensor, high: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    # 0 up to band `low`, 1 from band `high`, linear in between (a zero-width ramp is widened by 0.001)
    high = torch.where(high == low, high + 0.001, high)
    index = torch.arange(count, dtype=torch.float32, device=low.device)
    return ((index - low.float()) / (high.float() - low.float())).clamp(0, 1).to(dtype)


def dype_frequencies(
    dim: int,
    theta: float,
    train_length: int,
    length: int | float | torch.Tensor,
    timestep: float | torch.Tensor,
    method: str = "yarn",
    exponent: float = 2.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DyPE's frequencies of one axis at diffusion timestep ``timestep`` (1: pure noise, 0: clean), and the cos/sin
    multiplier: ``(freqs (dim / 2,), mscale (0-d))``.

    With s = length / train_length (nothing changes when s <= 1) and the schedule kappa(t) = lambda t^lambda
    (lambda = ``exponent``; 2 in the released code):

    - ``"yarn"`` (DY-YaRN): YaRN's two ramps over the band index, each bound raised to the power kappa(t): between
      position interpolation (theta_j / s) and an NTK base theta s^(d / (d - 2)) with the bounds 1.25^kappa and
      0.75^kappa turns over the training length, then between that and the original frequencies with 16^kappa
      and 2^kappa turns; the bands cut by the floor and ceiling of YaRN's inverse-dim formula. cos and sin are
      multiplied by 0.1 ln s + 1 at every timestep.
    - ``"ntk"`` (DY-NTK): the base theta times (s^(d / (d - 2)))^kappa(t) (at least theta); no multiplier.

    At t = 0, kappa = 0: every bound is 1 (the ramps collapse) and the NTK factor is 1, so the late steps see
    nearly the model's own frequencies; at t = 1 the extrapolation is YaRN's (or NTK's) with bounds raised to lambda.

    Args:
        dim: the axis' rotary channels (2 per pair).
        theta: the axis' RoPE base.
        train_length: the training length of the axis in positions (the released code's ``ori_max_pe_len``, 64 for
            Flux at 1024 px).
        length: the current length (largest position + 1); a 0-d tensor (read off the ids on their device) keeps
            the computation there: whether the axis is extrapolated is then decided on the device, without a host
            sync.
        timestep: t in [0, 1], a float or a 0-d tensor (a tensor keeps the computation on the device, without a
            host sync).
        method: one of :data:`DYPE_METHODS`.
        exponent: lambda_t > 0.
        dtype: the frequencies' dtype (float64 as the released code on CPU and CUDA).

    Example:
        >>> f0, m0 = dype_frequencies(8, 10000.0, 4, 8, 0.0)
        >>> f1, m1 = dype_frequencies(8, 10000.0, 4, 8, 1.0)
        >>> bool((f1 <= f0).all()), round(float(m1), 4)
        (True, 1.0693)
    """
    check_int(dim, "dim", min=4)
    check_int(train_length, "train_length", min=1)
    on_device = isinstance(length, torch.Tensor)
    if on_device and (length.ndim != 0 or length.is_complex() or length.dtype == torch.bool):
        raise ValueError(f"length must be a number or a real 0-d tensor, got shape {tuple(length.shape)}")
    if not on_device:
        check_float(length, "length", min=0, min_open=True, expected="a positive number of positions")
    check_choice(method, "method", DYPE_METHODS)
    check_float(exponent, "exponent", min=0, min_open=True, expected="a positive number (DyPE's lambda_t)")
    device = length.device if on_device else timestep.device if isinstance(timestep, torch.Tensor) else None
    base = rope_frequencies(dim, theta, dtype, device)
    t = timestep if isinstance(timestep, torch.Tensor) else torch.tensor(float(timestep), dtype=torch.float64)
    if not isinstance(timestep, torch.Tensor):
        check_float(timestep, "timestep", min=0, max=1, expected="a diffusion timestep in [0, 1]")
    t = t.to(device=base.device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    one = torch.ones((), dtype=dtype, device=base.device)
    if not on_device and length <= train_length:
        return base, one
    # s, as a Python float (the released code's) or as a float64 tensor on the ids' device
    scale = length.to(torch.float64) / train_length if on_device else float(length) / train_length
    kappa = exponent * t**exponent
    index = torch.arange(0, dim, 2, dtype=dtype, device=base.device)[: dim // 2] / dim
    if method == "ntk":
        factor = torch.clamp_min((scale ** (dim / (dim - 2))) ** kappa, 1.0).to(dtype)
        freqs, mscale = 1.0 / ((theta * factor) ** index), one
    else:
        linear = 1.0 / (scale * theta**index)
        ntk = 1.0 / ((theta * scale ** (dim / (dim - 2))) ** index)
        low, high = _correction_range(1.25**kappa, 0.75**kappa, dim, theta, train_length)
        mask = 1 - _ramp(low, high, dim // 2, dtype)
        freqs = linear * (1 - mask) + ntk * mask
        low, high = _correction_range(16**kappa, 2**kappa, dim, theta, train_length)
        mask = 1 - _ramp(low, high, dim // 2, dtype)
        freqs = freqs * (1 - mask) + base * mask
        log = torch.log(scale) if on_device else math.log(scale)
        mscale = torch.as_tensor(0.1 * log + 1.0, dtype=dtype, device=base.device)
    if on_device:  # an axis no longer than its training length keeps the model's own frequencies
        longer = length > train_length
        return torch.where(longer, freqs, base), torch.where(longer, mscale, one)
    return freqs, mscale


class DiffusionRotary(Extrapolation):
    """A diffusion transformer's axial RoPE: one block of ``axes_dim[a]`` interleaved channels per axis, base
    ``theta[a]``; positions in, per-token cos and sin out, under the mode set by :func:`visionpe.set_extrapolation`.

    Args:
        axes_dim: the channels of each axis' block, in the model's order (each even).
        theta: the base, one for every axis or one per axis.
        axis_names: the axes' names (``("index", "height", "width")`` for Flux, ``("time", "height", "width")`` for
            the video models); :func:`~visionpe.set_extrapolation`'s ``axes`` takes them.
        train_grid_size: the training length of each axis in positions (the grid the modes' factors are relative
            to); None: given later to ``set_extrapolation(..., train_grid_size=...)``.
        fixed_axes: axes no mode may scale (Flux's index axis, which numbers images rather than measuring a side).
        freqs_dtype: the dtype of the frequencies and angles (float64 for Flux and Wan on CPU and CUDA, float32 for
            HunyuanVideo and CogVideoX), as the model computes them.

    The modes: the scaling modes (``pi``, ``ntk``, ``yarn``), ``riflex`` (an axial spectrum: the band k of each
    named axis) and ``dype`` (:func:`dype_frequencies`, reading :attr:`timestep`, which the patched model sets at
    every forward call from its ``timestep`` argument).
    """

    axial_spectrum = True

    def __init__(
        self,
        axes_dim: Sequence[int],
        theta: float | Sequence[float],
        axis_names: Sequence[str],
        train_grid_size: Sequence[int] | None = None,
        *,
        fixed_axes: Sequence[str] = (),
        freqs_dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        if isinstance(axes_dim, (str, bytes)) or not isinstance(axes_dim, Sequence) or not axes_dim:
            raise TypeError(f"axes_dim must be a non-empty sequence of ints, got {axes_dim!r}")
        self.axes_dim = tuple(check_int(d, f"axes_dim[{a}]", min=2) for a, d in enumerate(axes_dim))
        odd = [d for d in self.axes_dim if d % 2]
        if odd:
            raise ValueError(f"axes_dim must be even (2 channels per rotary pair), got {self.axes_dim}")
        thetas = (theta,) * len(self.axes_dim) if isinstance(theta, (int, float)) else tuple(theta)
        if len(thetas) != len(self.axes_dim):
            raise ValueError(f"theta must be one base or one per axis ({len(self.axes_dim)}), got {theta!r}")
        self.thetas = tuple(
            check_float(t, f"theta[{a}]", min=0, min_open=True, expected="a positive base")
            for a, t in enumerate(thetas)
        )
        names = tuple(axis_names)
        if len(names) != len(self.axes_dim) or len(set(names)) != len(names):
            raise ValueError(f"axis_names must name each of the {len(self.axes_dim)} axes once, got {axis_names!r}")
        self.names = names
        unknown = [a for a in fixed_axes if a not in names]
        if unknown:
            raise ValueError(f"fixed_axes must be among axis_names {names}, got {tuple(fixed_axes)}")
        self.fixed_axes = tuple(fixed_axes)
        if freqs_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"freqs_dtype must be torch.float32 or torch.float64, got {freqs_dtype}")
        self.freqs_dtype = freqs_dtype
        self.ndims = (len(self.axes_dim),)
        # the diffusion timestep as the model's call passed it, and the factor taking it to [0, 1] (see timestep)
        self._timestep: tuple[float | torch.Tensor | None, float] = (None, 1.0)
        self.init_extrapolation("none", train_grid_size)

    @property
    def timestep(self) -> float | torch.Tensor | None:
        """The diffusion timestep t in [0, 1] (1: pure noise) that DyPE reads, or None: set by the patched model at
        every call from its ``timestep`` argument (:meth:`set_timestep`), or by hand (a float in [0, 1], a tensor)
        to run the rotary on its own. A tensor's largest entry is taken (one timestep per call: a batch is denoised
        at one step; a model given one timestep per token, as Wan 2.2's image-to-video with a clean first frame at
        0, denoises the others at the largest), in float64 (float32 on MPS), times the model's factor and clamped
        to [0, 1]."""
        value, scale = self._timestep
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            dtype = torch.float64 if value.device.type != "mps" else torch.float32
            return (value.detach().reshape(-1).amax().to(dtype) * scale).clamp(0, 1)
        return min(max(float(value) * scale, 0.0), 1.0)

    @timestep.setter
    def timestep(self, value: float | torch.Tensor | None) -> None:
        if value is not None and not isinstance(value, torch.Tensor):
            check_float(value, "timestep", min=0, max=1, expected="a diffusion timestep in [0, 1], a tensor or None")
        self.set_timestep(value)

    def set_timestep(self, value: float | torch.Tensor | None, scale: float = 1.0) -> None:
        """Keep the timestep a model's call passed, ``value``, and the factor ``scale`` taking it to [0, 1]: the
        conversion waits until DyPE reads :attr:`timestep`, so that the patched model's pre-hook adds no operation
        (and under ``torch.compile`` no graph) of its own."""
        if isinstance(value, bool) or not (value is None or isinstance(value, (torch.Tensor, int, float))):
            raise TypeError(f"timestep must be a number, a tensor or None, got {type(value).__name__} ({value!r})")
        self._timestep = (value, scale)

    @property
    def dim(self) -> int:
        """The rotated channels of a head: the sum of ``axes_dim``."""
        return sum(self.axes_dim)

    @property
    def supported_extrapolation(self) -> tuple[str, ...]:
        return SCALING_MODES + ("riflex", "dype")

    def axis_names(self, train_grid_size: Sequence[int] | None = None) -> tuple[str, ...]:
        return self.names

    def check_axes(
        self, mode: str, axes: Sequence[str] | None, train_grid_size: Sequence[int] | None = None
    ) -> tuple[int, ...] | None:
        """As :meth:`Extrapolation.check_axes`; an axis in ``fixed_axes`` is refused, and None selects every other
        axis."""
        fixed = [a for a in (axes or ()) if a in self.fixed_axes]
        if fixed:
            raise ValueError(
                f"axes must name axes a mode may scale, {tuple(n for n in self.names if n not in self.fixed_axes)}; "
                f"{fixed[0]!r} numbers the images rather than measuring a side, got axes={tuple(axes)}"
            )
        selected = super().check_axes(mode, axes, train_grid_size)
        if selected is None and self.fixed_axes:
            return tuple(a for a, n in enumerate(self.names) if n not in self.fixed_axes)
        return selected

    def check_added_mode_options(self, mode: str, **options: object) -> dict:
        """DyPE's options: ``dype_method`` (:data:`DYPE_METHODS`, default ``"yarn"``) and ``dype_exponent``
        (lambda_t > 0, default 2, as the released code)."""
        unknown = sorted(set(options) - {"dype_method", "dype_exponent"})
        if unknown or (options and mode != "dype"):
            raise UnsupportedSchemeError(
                f"{type(self).__name__} takes dype_method and dype_exponent with extrapolation='dype' only, "
                f"got extrapolation={mode!r} and {sorted(options)}"
            )
        if mode != "dype":
            return {}
        method = check_choice(options.get("dype_method", "yarn"), "dype_method", DYPE_METHODS)
        exponent = check_float(
            options.get("dype_exponent", 2.0), "dype_exponent", min=0, min_open=True, expected="a positive number"
        )
        return {"dype_method": method, "dype_exponent": exponent}

    def frequencies(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(ndim, P) frequencies, P = sum(axes_dim) / 2: row a holds axis a's frequencies on its block of pairs and
        zeros elsewhere (an axial spectrum); on ``device`` (default: the CPU)."""
        out = torch.zeros(len(self.axes_dim), self.dim // 2, dtype=self.freqs_dtype, device=device)
        start = 0
        for a, (d, theta) in enumerate(zip(self.axes_dim, self.thetas, strict=True)):
            out[a, start : start + d // 2] = rope_frequencies(d, theta, self.freqs_dtype, device)
            start += d // 2
        return out

    def axis_frequencies(
        self, grid_size: Sequence[int] | torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor | float]]:
        """Per axis, its (d_a / 2,) frequencies under the current mode for a grid of ``grid_size`` positions per
        axis, and the multiplier of its cos and sin (YaRN's on every axis, DyPE's per axis, 1 otherwise).

        ``grid_size`` may be a (ndim,) tensor, the grid read off the model's ids on their device: the mode is then
        computed there, equal to the same grid given as ints, with no host synchronisation (so the rotary traces
        into one ``torch.compile`` graph)."""
        if self.extrapolation == "none" or grid_size is None:
            return [
                (rope_frequencies(d, t, self.freqs_dtype), 1.0) for d, t in zip(self.axes_dim, self.thetas, strict=True)
            ]
        if isinstance(grid_size, torch.Tensor):
            if grid_size.shape != (len(self.axes_dim),):
                raise ValueError(
                    f"grid_size must be a ({len(self.axes_dim)},) tensor of positions per axis, "
                    f"got shape {tuple(grid_size.shape)}"
                )
            device = grid_size.device
        else:
            grid_size, device = validate_grid_size(grid_size, ndims=self.ndims), None
        if self.extrapolation == "dype":
            return self._dype(grid_size)
        freqs, mscale = self.adjust_frequencies(self.frequencies(device), grid_size)
        out, start = [], 0
        for a, d in enumerate(self.axes_dim):
            out.append((freqs[a, start : start + d // 2], mscale))
            start += d // 2
        return out

    def _dype(self, grid_size: tuple[int, ...] | torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | float]]:
        timestep = self.timestep
        if timestep is None:
            raise RuntimeError(
                "extrapolation='dype' reads the diffusion timestep, which the patched transformer sets at every call "
                "from its timestep argument; set DiffusionRotary.timestep to run the rotary on its own"
            )
        selected = self.extrapolation_axes
        out = []
        for a, (d, theta) in enumerate(zip(self.axes_dim, self.thetas, strict=True)):
            shorter = not isinstance(grid_size, torch.Tensor) and grid_size[a] <= self.train_grid_size[a]
            if (selected is not None and a not in selected) or shorter:
                out.append((rope_frequencies(d, theta, self.freqs_dtype), 1.0))
                continue
            out.append(
                dype_frequencies(
                    d,
                    theta,
                    self.train_grid_size[a],
                    grid_size[a],
                    timestep,
                    self.mode_options["dype_method"],
                    self.mode_options["dype_exponent"],
                    self.freqs_dtype,
                )
            )
        return out

    def axis_angles(
        self, positions: torch.Tensor, grid_size: Sequence[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor | float]]:
        """Per axis, the rotation angles of its pairs, (S, axes_dim[a] / 2) in the frequency dtype, and the
        multiplier of their cos and sin (1.0 where the mode sets none): what :meth:`cos_sin` and :meth:`polar` turn
        into the model's layout.

        Args:
            positions: (S, ndim) positions (float or int; fractional positions are taken as they are; negative ones,
                as the centred grids of Qwen-Image, too).
            grid_size: the number of positions per axis of the current input, which the modes compare with the
                training grid; None: the mode is not applied (as at the training size).
        """
        if not isinstance(positions, torch.Tensor) or positions.ndim != 2 or positions.shape[1] != len(self.axes_dim):
            raise ValueError(
                f"positions must be a (S, {len(self.axes_dim)}) tensor, got {getattr(positions, 'shape', positions)}"
            )
        dtype = self.freqs_dtype if positions.device.type != "mps" else torch.float32
        return [
            (positions[:, a].float().to(dtype)[:, None] * freqs.to(device=positions.device, dtype=dtype), mscale)
            for a, (freqs, mscale) in enumerate(self.axis_frequencies(grid_size))
        ]

    def cos_sin(
        self, positions: torch.Tensor, grid_size: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos and sin, (S, dim) float32 each, every pair's value repeated on its two channels
        (diffusers' ``repeat_interleave_real``), the axes' blocks in order (Flux's layout).

        Args:
            positions: (S, ndim) positions, as :meth:`axis_angles` takes them.
            grid_size: the number of positions per axis of the current input (None: the mode is not applied).
        """
        cos, sin = [], []
        for angle, mscale in self.axis_angles(positions, grid_size):
            c, s = angle.cos(), angle.sin()
            if not (isinstance(mscale, float) and mscale == 1.0):
                c, s = c * mscale, s * mscale
            cos.append(c.repeat_interleave(2, dim=1).float())
            sin.append(s.repeat_interleave(2, dim=1).float())
        return torch.cat(cos, dim=1), torch.cat(sin, dim=1)

    def polar(self, positions: torch.Tensor, grid_size: Sequence[int] | None = None) -> torch.Tensor:
        """Per-token rotations as complex numbers, (S, dim / 2) complex64: pair j of a token is
        ``mscale * exp(i * angle_j)`` (``torch.polar``), the axes' blocks in order (Qwen-Image's layout, applied by
        a complex product with the (real, imaginary) channel pairs).

        Args:
            positions: (S, ndim) positions, as :meth:`axis_angles` takes them.
            grid_size: the number of positions per axis of the current input (None: the mode is not applied).
        """
        out = []
        for angle, mscale in self.axis_angles(positions, grid_size):
            if isinstance(mscale, float):
                magnitude = torch.full_like(angle, mscale)
            else:
                magnitude = mscale.to(device=angle.device, dtype=angle.dtype).expand_as(angle)
            out.append(torch.polar(magnitude, angle).to(torch.complex64))
        return torch.cat(out, dim=1)

    def extra_repr(self) -> str:
        return (
            f"axes={dict(zip(self.names, self.axes_dim, strict=True))}, theta={self.thetas}, "
            f"train_grid_size={self.train_grid_size}, extrapolation={self.extrapolation!r}"
        )
