"""Diffusion transformers with an absolute 2-D sin-cos position table (SD3, PixArt, DiT): the table in visionpe.

diffusers' ``PatchEmbed`` adds a fixed sin-cos table to the patch tokens. Along each axis of a grid of n patches
the positions are ``arange(n) / (n / base_size) / interpolation_scale`` (``base_size``: the training side in
patches, ``sample_size // patch_size``); a token's D channels are ``[sin(x w), cos(x w), sin(y w), cos(y w)]`` with
x its column's position, y its row's and w_k = 10000^(-k / (D / 4)), k < D / 4: the layout of visionpe's
:func:`~visionpe.absolute.sincos.sincos_2d`. Two uses of it:

- SD3 (``SD3Transformer2DModel``, ``pos_embed_max_size`` 192 in the released models): one persistent table on a
  square grid of ``pos_embed_max_size`` patches, saved with the weights, of which an input of h x w patches takes
  the centre crop (rows ``(M - h) // 2`` on, columns ``(M - w) // 2`` on); an input wider than the table raises.
  :class:`CroppedSinCosPatchEmbed`.
- PixArt (``PixArtTransformer2DModel``), DiT (``DiTTransformer2DModel``) and the patch-input
  ``Transformer2DModel``, and an SD3 model built with ``pos_embed_max_size=None``: the table of a new grid is
  recomputed with the formula above, whose positions span ``[0, base_size / interpolation_scale)`` whatever n:
  position interpolation is built in. :class:`InterpolatedSinCosPatchEmbed`.

:func:`~visionpe.integrations.diffusers.apply_position_scheme` replaces the model's ``PatchEmbed`` by one of these
(the same ``proj`` and ``norm`` modules, so the same weights and state-dict keys; SD3's table keeps its persistent
``pos_embed`` key, PixArt's stays out of the state dict as in diffusers). Their table is visionpe's
(:func:`sincos_table` on the positions per axis, :func:`grid_positions` for diffusers' formula), checked against the
model's own when the model is patched: with no mode set the denoiser's output equals the original's. The modes
(``visionpe.set_extrapolation(transformer, mode, axes=...)``):

- SD3, ``"pi"``: on each named axis longer than its training length n0 (``train_grid_size``, by default the model's
  ``sample_size // patch_size``), the n positions start at the training crop's first position and step by the
  table's step times n0 / n: a larger crop compressed into the training crop's extent, PixArt's built-in rule (for a
  table whose crop starts at 0 it is PixArt's formula exactly). The positions are computed, not cropped, so the
  table's size limit does not apply to those axes.
- PixArt: ``"none"`` only, which is its own position interpolation.

NTK, YaRN, RIFLEx and DyPE are refused with the reason: they edit a rotary's frequencies band by band (and RIFLEx a
time axis, DyPE over the timestep), which no reference defines for an absolute table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ...checks import check_float, check_int, check_tensor
from ...rotary.scaling import DIFFUSION_MODES, EXTRAPOLATION_MODES, Extrapolation
from .patch import DiffusionFamily, register_family

__all__ = [
    "PIXART",
    "SD3",
    "CroppedSinCosPatchEmbed",
    "InterpolatedSinCosPatchEmbed",
    "SinCosPatchEmbed",
    "grid_positions",
    "sincos_frequencies",
    "sincos_table",
]

_AXES = ("height", "width")


def _compute_dtype(device: torch.device | str | None) -> torch.dtype:
    # diffusers computes the table in float64, float32 on MPS (no float64 there)
    return torch.float32 if torch.device(device or "cpu").type == "mps" else torch.float64


def grid_positions(length: int, base_size: float, interpolation_scale: float = 1.0, device=None) -> torch.Tensor:
    """diffusers' positions along one axis of ``length`` patches: ``arange(length) / (length / base_size) /
    interpolation_scale``, in float32 as diffusers computes them.

    Example:
        >>> grid_positions(4, 2)  # 4 patches spanning the extent of a 2-patch training side
        tensor([0.0000, 0.5000, 1.0000, 1.5000])
    """
    check_int(length, "length", min=1)
    check_float(base_size, "base_size", min=0, min_open=True, expected="a positive number of patches")
    check_float(interpolation_scale, "interpolation_scale", min=0, min_open=True, expected="a positive number")
    return torch.arange(length, device=device, dtype=torch.float32) / (length / base_size) / interpolation_scale


def sincos_frequencies(dim: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The (dim / 4,) frequencies of one axis of a ``dim``-channel 2-D table, w_k = 10000^(-k / (dim / 4)), computed
    as diffusers computes them.

    Example:
        >>> sincos_frequencies(8)
        tensor([1.0000, 0.0100], dtype=torch.float64)
    """
    check_int(dim, "dim", min=4)
    if dim % 4:
        raise ValueError(f"dim must be divisible by 4 (sin and cos of two axes), got {dim}")
    omega = torch.arange(dim // 4, device=device, dtype=dtype)
    omega /= dim / 4.0
    return 1.0 / 10000**omega


def sincos_table(
    rows: torch.Tensor,
    cols: torch.Tensor,
    dim: int,
    dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(len(rows) * len(cols), dim) 2-D sin-cos table, tokens row-major: token r * len(cols) + c is
    ``[sin(cols[c] w), cos(cols[c] w), sin(rows[r] w), cos(rows[r] w)]``, w = :func:`sincos_frequencies`.

    The layout of :func:`visionpe.absolute.sincos.sincos_2d` (column first, sin then cos, the same w), which is
    diffusers' ``get_2d_sincos_pos_embed``; computed in ``dtype`` (default float64, float32 on MPS) as diffusers
    does: ``sincos_2d`` works in float32, whose angles at SD3's positions (up to 64 with w_0 = 1) are off by a few
    1e-6, and so would be the denoiser's output.

    Args:
        rows: (H,) positions of the rows (the height axis).
        cols: (W,) positions of the columns (the width axis).
        dim: the channels (divisible by 4).
        dtype: the computation's dtype.
        out_dtype: the result's dtype (default ``dtype``); each axis' block is cast before it is tiled over the grid,
            the same values in less memory (SD3's 192 x 192 x 1536 table is 0.45 GB in float64).

    Example:
        >>> sincos_table(torch.tensor([0.0]), torch.tensor([0.0, 1.0]), 4).float()
        tensor([[0.0000, 1.0000, 0.0000, 1.0000],
                [0.8415, 0.5403, 0.0000, 1.0000]])
    """
    for name, value in (("rows", rows), ("cols", cols)):
        check_tensor(value, name, dtype="real")
        if value.ndim != 1 or not value.numel():
            raise ValueError(f"{name} must be a non-empty 1-D tensor of positions, got shape {tuple(value.shape)}")
    if rows.device != cols.device:
        raise ValueError(f"rows and cols must be on one device, got {rows.device} and {cols.device}")
    dtype = dtype or _compute_dtype(rows.device)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    out_dtype = out_dtype or dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating-point torch.dtype, got {out_dtype!r}")
    omega = sincos_frequencies(dim, dtype, rows.device)

    def axis(pos: torch.Tensor) -> torch.Tensor:
        angle = torch.outer(pos.to(dtype), omega)
        return torch.cat([angle.sin(), angle.cos()], dim=1).to(out_dtype)

    x, y = axis(cols), axis(rows)  # (W, D / 2), (H, D / 2)
    h, w = len(rows), len(cols)
    return torch.cat([x[None].expand(h, w, -1), y[:, None].expand(h, w, -1)], dim=-1).reshape(h * w, dim)


def _storage_dtype(table: torch.Tensor) -> torch.dtype:
    """The coarsest of bfloat16, float16 and the table's dtype that holds every value of ``table`` exactly: the
    precision a checkpoint stored it in (a float32 model loaded from a float16 file has float16 values)."""
    for dtype in (torch.bfloat16, torch.float16):
        if table.dtype.itemsize <= torch.finfo(dtype).bits // 8:
            return table.dtype
        if torch.equal(table.to(dtype).to(table.dtype), table):
            return dtype
    return table.dtype


def _axis_positions_from_table(half: torch.Tensor) -> torch.Tensor:
    """The positions behind one axis' (n, D / 2) ``[sin | cos]`` block, read from its phases: the slowest band
    gives a first estimate (its phase turns less than half a turn over the positions of a table), each faster band
    refines it by the whole turns that estimate implies."""
    quarter = half.shape[1] // 2
    omega = sincos_frequencies(2 * half.shape[1])
    phase = torch.atan2(half[:, :quarter].double(), half[:, quarter:].double())
    position = phase[:, -1] / omega[-1]
    for k in range(quarter - 2, -1, -1):
        turns = torch.round((position * omega[k] - phase[:, k]) / (2 * math.pi))
        position = (phase[:, k] + 2 * math.pi * turns) / omega[k]
    return position


def _fit_line(values: torch.Tensor) -> tuple[float, float]:
    """Least-squares (step, origin) of ``values[i] ~ step * i + origin``."""
    index = torch.arange(len(values), dtype=torch.float64)
    if len(values) == 1:
        return 1.0, float(values[0])
    centred = index - index.mean()
    step = float((centred * (values - values.mean())).sum() / (centred**2).sum())
    return step, float(values.mean() - step * index.mean())


class SinCosPatchEmbed(Extrapolation):
    """diffusers' ``PatchEmbed`` with its sin-cos table from visionpe: the same ``proj`` (and ``norm``) modules,
    the table added to the flattened patch tokens. The common part of :class:`CroppedSinCosPatchEmbed` (SD3) and
    :class:`InterpolatedSinCosPatchEmbed` (PixArt), which define the positions of a grid (``positions(height,
    width)``) and its (1, height * width, D) table under the current mode (``table(height, width, device)``).

    Args:
        patch_embed: the model's ``PatchEmbed`` with a sin-cos table (``pos_embed_type="sincos"``, flattened tokens).
        train_grid_size: the training grid in patches (height, width), the modes' reference; None: the model's
            ``sample_size // patch_size`` on each side.
    """

    ndims = (2,)
    #: the ``timestep`` argument of the patched model's last call (its pre-hook hands it over); no table mode reads it
    timestep: float | torch.Tensor | None = None

    def __init__(self, patch_embed: nn.Module, train_grid_size: Sequence[int] | None = None) -> None:
        super().__init__()
        if not isinstance(patch_embed, nn.Module) or not isinstance(getattr(patch_embed, "proj", None), nn.Conv2d):
            raise TypeError(f"patch_embed must be diffusers' PatchEmbed, got {type(patch_embed).__name__}")
        table = getattr(patch_embed, "pos_embed", None)
        if not isinstance(table, torch.Tensor):
            raise ValueError(
                f"patch_embed must hold a sin-cos table (pos_embed_type='sincos'), got pos_embed={table!r}: "
                "the model has no absolute position table for visionpe to express"
            )
        if not getattr(patch_embed, "flatten", True):
            raise ValueError("patch_embed must flatten its tokens (flatten=True), as the table is added per token")
        self.proj = patch_embed.proj
        self.norm = patch_embed.norm
        self.layer_norm = bool(patch_embed.layer_norm)
        self.patch_size = int(patch_embed.patch_size)
        self.height, self.width = int(patch_embed.height), int(patch_embed.width)
        self.base_size = patch_embed.base_size
        self.interpolation_scale = patch_embed.interpolation_scale
        self.pos_embed_max_size = patch_embed.pos_embed_max_size
        self.dim = int(table.shape[-1])
        self.init_extrapolation("none", train_grid_size or (self.height, self.width))

    def _check_table(self, own: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, float]:
        """visionpe's table on ``rows`` x ``cols`` in the model's table precision, and its largest difference from
        the model's table ``own`` (1, H W, D)."""
        storage = _storage_dtype(own)
        table = sincos_table(rows.to(own.device), cols.to(own.device), self.dim, out_dtype=torch.float32)
        table = table.to(storage).to(own.dtype)[None]
        if table.shape != own.shape:
            return table, math.inf
        return table, float((table.float() - own.float()).abs().max())

    @staticmethod
    def _tolerance(own: torch.Tensor, *positions: torch.Tensor) -> float:
        # the rounding of the model's table, and that of float32 positions (a checkpoint's may carry it)
        largest = max(1.0, *(float(p.abs().max()) for p in positions))
        return max(torch.finfo(_storage_dtype(own)).eps, 8 * largest * 2.0**-24)

    def set_timestep(self, value: float | torch.Tensor | None, scale: float = 1.0) -> None:
        """Keep the ``timestep`` argument of the patched model's call as :attr:`timestep`, as the model's pre-hook
        hands it to every patched module; ``scale`` (the factor to DyPE's [0, 1]) is not needed: no table mode
        depends on the timestep."""
        self.timestep = value

    @property
    def supported_extrapolation(self) -> tuple[str, ...]:
        return ("none",)

    def mode_refusal(self, mode: str) -> str | None:
        """Why a table refuses ``mode`` (None for a supported one)."""
        name = type(self).__name__
        if mode in self.supported_extrapolation:
            return None
        supported = f"{name} supports extrapolation modes {self.supported_extrapolation}"
        if mode in ("ntk", "yarn"):
            return (
                f"{supported}, got {mode!r}: {mode} rescales a rotary's frequencies band by band, so that relative "
                "phases stay in the trained range; on an absolute table added to the tokens it would give each band "
                "another position for the same token, which no reference defines"
            )
        if mode == "riflex":
            return (
                f"{supported}, got 'riflex': RIFLEx lowers the one rotary band whose period makes a video repeat "
                "along time; an image's sin-cos table has neither rotary bands nor a time axis"
            )
        if mode in DIFFUSION_MODES:
            return (
                f"{supported}, got {mode!r}: it schedules a rotary's frequencies over the diffusion timestep; "
                "the model encodes positions with an absolute table, not a rotary"
            )
        return f"{supported}, got {mode!r}"

    def extrapolation_refusal(self, mode: str, train_grid_size: tuple[int, ...] | None = None) -> str | None:
        if mode in EXTRAPOLATION_MODES + DIFFUSION_MODES:
            reason = self.mode_refusal(mode)
            if reason is not None:
                return reason
        return super().extrapolation_refusal(mode, train_grid_size)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        height, width = latent.shape[-2] // self.patch_size, latent.shape[-1] // self.patch_size
        latent = self.proj(latent)
        latent = latent.flatten(2).transpose(1, 2)  # BCHW -> BNC
        if self.layer_norm:
            latent = self.norm(latent)
        return (latent + self.table(height, width, latent.device)).to(latent.dtype)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, patch_size={self.patch_size}, base_size={self.base_size}, "
            f"interpolation_scale={self.interpolation_scale}, train_grid_size={self.train_grid_size}, "
            f"extrapolation={self.extrapolation!r}"
        )


class CroppedSinCosPatchEmbed(SinCosPatchEmbed):
    """SD3's ``PatchEmbed``: a persistent table on a square grid of M = ``pos_embed_max_size`` patches (state-dict
    key ``pos_embed``, as the model's), centre-cropped to the input's grid; ``"pi"`` compresses a larger crop.

    The table's positions per axis are diffusers' (:func:`grid_positions` of M patches); a model whose loaded table
    is another sin-cos table of evenly spaced positions (SD3's reference code builds it with a scaling factor and an
    offset) gets those, read from the table's phases. A table that is neither raises a ValueError, so that a patched
    model never adds another table than its own. Patch the model after loading its weights.

    Modes (``visionpe.set_extrapolation``, ``axes`` among ``("height", "width")``):

    - ``"none"``: the model's own: the centre crop, and a ValueError for a side longer than M patches, as diffusers.
    - ``"pi"``: on a named axis of n > n0 patches (n0: the training grid's), the positions
      ``p[top0] + j * step * n0 / n``, j < n, where ``p`` are the table's positions, ``step`` their spacing and
      ``top0 = (M - n0) // 2`` the first row (column) of the training crop: n positions over the training crop's
      extent, as PixArt's table. Any n (no limit of M on those axes); shorter axes keep the crop.

    Example (a tiny random SD3; the released one: ``from_pretrained(..., subfolder="transformer")``):
        >>> import torch, visionpe
        >>> from diffusers import SD3Transformer2DModel
        >>> from visionpe.integrations.diffusers import apply_position_scheme, patched_rotary
        >>> m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
        ...     num_attention_heads=1, joint_attention_dim=8, caption_projection_dim=8, pooled_projection_dim=8,
        ...     out_channels=4, pos_embed_max_size=8)
        >>> report = apply_position_scheme(m)
        >>> visionpe.set_extrapolation(m, "pi")
        ['pos_embed']
        >>> rows, cols = patched_rotary(m).positions(8, 8)  # twice the training side, compressed into its extent
        >>> rows[:3].tolist(), round(float(rows[-1]), 3)
        ([1.0, 1.25, 1.5], 2.75)
    """

    def __init__(self, patch_embed: nn.Module, train_grid_size: Sequence[int] | None = None) -> None:
        super().__init__(patch_embed, train_grid_size)
        size = check_int(self.pos_embed_max_size, "pos_embed_max_size", min=1)
        reason = self.extrapolation_refusal("none")
        if reason is not None:
            raise ValueError(reason)
        own = patch_embed.pos_embed
        if own.shape != (1, size * size, self.dim):
            raise ValueError(f"pos_embed must be a (1, {size * size}, {self.dim}) table, got {tuple(own.shape)}")
        grid = grid_positions(size, self.base_size, self.interpolation_scale).double()
        #: the table's positions per axis (rows, columns) and their spacing
        self.grid = (grid, grid)
        self.step = (self.base_size / size / self.interpolation_scale,) * 2
        table, error = self._check_table(own, grid, grid)
        tolerance = self._tolerance(own, grid)
        if error > tolerance:  # another scale or offset than diffusers' formula: read the positions off the table
            spatial = own[0].reshape(size, size, self.dim)
            cols = _axis_positions_from_table(spatial[0, :, : self.dim // 2])
            rows = _axis_positions_from_table(spatial[:, 0, self.dim // 2 :])
            fits = [_fit_line(rows), _fit_line(cols)]
            index = torch.arange(size, dtype=torch.float64)
            self.grid = tuple(step * index + origin for step, origin in fits)
            self.step = tuple(step for step, _ in fits)
            table, error = self._check_table(own, *self.grid)
            tolerance = self._tolerance(own, *self.grid)
            if error > tolerance:
                raise ValueError(
                    f"patch_embed.pos_embed must be a 2-D sin-cos table of evenly spaced positions for visionpe to "
                    f"express it, but it differs from the nearest one by {error:.3g} (more than the {tolerance:.3g} "
                    "of its rounding): a table that was trained, or a checkpoint stored in another precision than "
                    "its values"
                )
        self.register_buffer("pos_embed", table, persistent=True)

    @property
    def supported_extrapolation(self) -> tuple[str, ...]:
        return ("none", "pi")

    def extrapolation_refusal(self, mode: str, train_grid_size: tuple[int, ...] | None = None) -> str | None:
        train = train_grid_size or self.train_grid_size
        if train is not None and len(train) == 2 and max(train) > self.pos_embed_max_size:
            return (
                f"train_grid_size must fit the model's table of {self.pos_embed_max_size} x "
                f"{self.pos_embed_max_size} patches (no larger input was ever encoded), got {tuple(train)}"
            )
        return super().extrapolation_refusal(mode, train_grid_size)

    def _compressed(self, height: int, width: int) -> tuple[bool, bool]:
        factors = self.scale_factors((height, width))
        return (False, False) if factors is None else (factors[0] > 1, factors[1] > 1)

    def _check_side(self, name: str, length: int) -> None:
        if length > self.pos_embed_max_size:
            raise ValueError(
                f"{name} ({length}) cannot be greater than `pos_embed_max_size`: {self.pos_embed_max_size}. "
                "(visionpe.set_extrapolation(transformer, 'pi') compresses a larger crop into the training extent)"
            )

    def positions(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (height,), columns (width,)) float64 positions of a grid of patches under the current mode."""
        check_int(height, "height", min=1)
        check_int(width, "width", min=1)
        size = self.pos_embed_max_size
        out = []
        for axis, (name, n, compressed) in enumerate(
            zip(("Height", "Width"), (height, width), self._compressed(height, width), strict=True)
        ):
            grid = self.grid[axis]
            if compressed:
                n0 = self.train_grid_size[axis]
                start = grid[(size - n0) // 2]  # the training crop's first position
                out.append(start + torch.arange(n, dtype=torch.float64) * (self.step[axis] * n0 / n))
            else:
                self._check_side(name, n)
                top = (size - n) // 2
                out.append(grid[top : top + n])
        return out[0], out[1]

    def table(self, height: int, width: int, device=None) -> torch.Tensor:
        if not any(self._compressed(height, width)):  # the model's own crop
            self._check_side("Height", height)
            self._check_side("Width", width)
            size = self.pos_embed_max_size
            top, left = (size - height) // 2, (size - width) // 2
            spatial = self.pos_embed.reshape(1, size, size, -1)[:, top : top + height, left : left + width, :]
            return spatial.reshape(1, -1, spatial.shape[-1])
        rows, cols = self.positions(height, width)
        device = device or self.pos_embed.device
        table = sincos_table(rows.to(device), cols.to(device), self.dim, out_dtype=torch.float32)
        return table.to(self.pos_embed.dtype)[None]


class InterpolatedSinCosPatchEmbed(SinCosPatchEmbed):
    """PixArt's (DiT's, ``Transformer2DModel``'s) ``PatchEmbed``: the table of the training grid (not saved with
    the weights, as in diffusers), recomputed for another grid with :func:`grid_positions` on each axis, whose
    positions span the training extent at any size.

    Modes: ``"none"`` only, the model's own position interpolation; the others are refused with the reason (``"pi"``:
    there is no position beyond the training extent to compress).

    Example:
        >>> from diffusers import PixArtTransformer2DModel
        >>> from visionpe.integrations.diffusers import apply_position_scheme, patched_rotary
        >>> m = PixArtTransformer2DModel(num_attention_heads=1, attention_head_dim=8, in_channels=4, out_channels=8,
        ...     num_layers=1, cross_attention_dim=8, sample_size=8, patch_size=2, caption_channels=8)
        >>> report = apply_position_scheme(m)
        >>> patched_rotary(m).positions(8, 4)[0].tolist()  # 8 rows over the extent of the 4 trained
        [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    """

    def __init__(self, patch_embed: nn.Module, train_grid_size: Sequence[int] | None = None) -> None:
        super().__init__(patch_embed, train_grid_size)
        own = patch_embed.pos_embed
        side = int((self.height * self.width) ** 0.5)  # diffusers' table at construction: a square grid
        grid = grid_positions(side, self.base_size, self.interpolation_scale).double()
        table, error = self._check_table(own, grid, grid)
        tolerance = self._tolerance(own, grid)
        if error > tolerance:
            raise ValueError(
                f"patch_embed.pos_embed must be diffusers' sin-cos table of the training grid ({side} x {side} "
                f"patches), but it differs from it by {error:.3g} (more than the {tolerance:.3g} of its rounding)"
            )
        self.register_buffer("pos_embed", table, persistent=False)

    def mode_refusal(self, mode: str) -> str | None:
        if mode == "pi":
            return (
                f"{type(self).__name__} supports extrapolation modes {self.supported_extrapolation}, got 'pi': the "
                "model's table interpolates positions already (extrapolation='none' is its own position "
                "interpolation: the positions of any grid span the training extent), so no position lies beyond "
                "the training extent for 'pi' to compress"
            )
        return super().mode_refusal(mode)

    def positions(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (height,), columns (width,)) float64 positions of a grid of patches."""
        check_int(height, "height", min=1)
        check_int(width, "width", min=1)
        return tuple(grid_positions(n, self.base_size, self.interpolation_scale).double() for n in (height, width))

    def table(self, height: int, width: int, device=None) -> torch.Tensor:
        if (height, width) == (self.height, self.width):
            return self.pos_embed
        rows, cols = self.positions(height, width)
        device = device or self.pos_embed.device
        # diffusers adds a recomputed table in float32, whatever the model's dtype
        return sincos_table(rows.to(device), cols.to(device), self.dim, out_dtype=torch.float32)[None]


def _build(model: nn.Module, own: nn.Module, train_grid_size) -> SinCosPatchEmbed:
    if getattr(own, "pos_embed_max_size", None):
        return CroppedSinCosPatchEmbed(own, train_grid_size)
    return InterpolatedSinCosPatchEmbed(own, train_grid_size)


SD3 = register_family(
    DiffusionFamily(
        name="sd3",
        class_names=("SD3Transformer2DModel",),
        attribute="pos_embed",
        build=_build,
        timestep_scale=1 / 1000,
        axis_names=_AXES,
        default_train_grid=(64, 64),
        own_module_class="PatchEmbed",
        notes="a centre-cropped sin-cos table (CroppedSinCosPatchEmbed); the training grid defaults to the model's "
        "sample_size // patch_size (64 x 64 patches for the released 1024 px models)",
    )
)

PIXART = register_family(
    DiffusionFamily(
        name="pixart",
        class_names=("PixArtTransformer2DModel", "DiTTransformer2DModel", "Transformer2DModel"),
        attribute="pos_embed",
        build=_build,
        timestep_scale=1 / 1000,
        axis_names=_AXES,
        default_train_grid=(64, 64),
        own_module_class="PatchEmbed",
        notes="a sin-cos table recomputed per grid with positions spanning the training extent "
        "(InterpolatedSinCosPatchEmbed); the training grid defaults to the model's sample_size // patch_size",
    )
)
