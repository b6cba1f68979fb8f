"""Token coordinates for 2D (h, w) and 3D (t, h, w) patch grids: the one place coordinates are built.

Tokens are stored row-major (k = y * W + x for 2D, k = (t * H + y) * W + x for 3D). The coordinate
columns follow the grid axes: ``(y, x)`` for 2D and ``(t, y, x)`` for 3D. Prefix tokens (cls and
registers) come before the patch tokens and have no grid coordinate; see :func:`prefix_mask`.

Coordinate modes (``coord_mode`` of every scheme):

- ``index``: integer positions, x in {0..W-1};
- ``centered``: i - (n - 1) / 2;
- ``normalized``: (i + 0.5) / n, in (0, 1);
- ``ref_scaled``: i * n_ref / n, position interpolation to a reference grid.

:func:`grid_coords` also builds ``normalized_pm1``, 2 (i + 0.5) / n - 1 in (-1, 1), the convention of DINOv3
(``rope_dinov3``); it is not among the modes every scheme takes (:data:`COORD_MODES`).

Training-time coordinate augmentation (:class:`CoordAugment`, set on a model with
:func:`~visionpe.base.set_coord_augment`) draws the coordinates of a training forward instead of reading them off
the grid:

- ``randomized``: Ruoss et al., "Randomized Positional Encodings Boost Length Generalization of Transformers",
  ACL 2023. Per axis, a sorted sample without replacement of the n_a positions from {0..L_a - 1}
  (:func:`randomized_positions`); the product of the axes keeps rows, columns and their order.
- ``pose``: Zhu et al., "PoSE: Efficient Context Window Extension of LLMs via Positional Skip-wise Training",
  ICLR 2024. Per axis, one cut c_a in [1, n_a - 1]; positions c_a.. are shifted by u_a in {0..L_a - n_a}
  (:func:`skip_positions`), four skipped quadrants in 2D.
- ``dinov3``: Siméoni et al., "DINOv3", arXiv 2508.10104, 2025. The coordinates are shifted by U(-s, s) per axis,
  scaled by exp(U(-ln J, ln J)) per axis, then by exp(U(-ln S, ln S)) shared by the axes, in that order
  (:func:`shift_jitter_rescale`).

The 2D forms (one cut or one sample per axis) are the library's reading of the 1D papers. Evaluation never draws:
a model in eval mode reads exactly :func:`grid_coords`.

Mixed-resolution batches (timm's NaFlex layout): each sample of a batch is a grid of its own size, given as
``patch_coord`` (B, N, ndim), the integer (y, x) index of each patch, and ``patch_valid`` (B, N), True on real patches;
each sample lists the patches of its grid in raster order first, padding after. :func:`mixed_grid` validates such a
batch and derives each sample's grid and the groups of samples that share one (:class:`MixedGrid`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from .checks import check_choice, check_float, check_instance, check_int, check_positive, describe

if TYPE_CHECKING:
    pass

__all__ = [
    "COORD_MODES",
    "GRID_COORD_MODES",
    "COORD_AUGMENT_KINDS",
    "CoordAugment",
    "MixedGrid",
    "mixed_grid",
    "grid_coords",
    "grid_rows",
    "is_symbolic_grid",
    "prefix_mask",
    "randomized_coords",
    "randomized_positions",
    "shift_jitter_rescale",
    "skip_coords",
    "skip_positions",
    "validate_count",
    "validate_grid_size",
    "validate_positive",
]

COORD_MODES = ("index", "centered", "normalized", "ref_scaled")
#: the modes :func:`grid_coords` builds: :data:`COORD_MODES` and DINOv3's ``normalized_pm1``
GRID_COORD_MODES = (*COORD_MODES, "normalized_pm1")
COORD_AUGMENT_KINDS = ("randomized", "pose", "dinov3")


def validate_count(value: int, name: str = "num_prefix_tokens") -> int:
    """``value`` if it is a non-negative int (not a bool): :func:`~visionpe.checks.check_int` with ``min=0``.

    A negative value raises ValueError; another type raises :class:`~visionpe.checks.ArgumentTypeError`, a
    TypeError that is also a ValueError.

    Example:
        >>> validate_count(1)
        1
    """
    return check_int(value, name, min=0)


def validate_positive(value: float, name: str) -> float:
    """``value`` as a float if it is a positive finite number (:func:`~visionpe.checks.check_positive`): TypeError
    naming ``name`` for a non-number (bool included), ValueError for zero, negative, inf or NaN.

    Example:
        >>> validate_positive(2, "ratio")
        2.0
    """
    return check_positive(value, name)


def validate_grid_size(grid_size: Sequence[int], name: str = "grid_size", ndims: Sequence[int] = (2, 3)) -> tuple:
    """Check that ``grid_size`` is a tuple of positive ints with an allowed length; return it as a tuple.

    Integer tensors, NumPy arrays and NumPy integers are accepted (as Python ints); floats are not, even 2.0.
    """
    if isinstance(grid_size, torch.Tensor) or type(grid_size).__module__ == "numpy":
        grid_size = grid_size.tolist()
    if not isinstance(grid_size, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(grid_size).__name__}")
    if len(grid_size) not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} entries, got {len(grid_size)}: {grid_size}")
    out = []
    for i, g in enumerate(grid_size):
        if isinstance(g, torch.SymInt):
            # a symbolic size (torch.export / ONNX export with dynamic height and width): kept symbolic, so that
            # the exported graph runs at any grid; operator.index or a Python branch would fix its traced value
            torch._check(g >= 1, lambda i=i: f"{name}[{i}] must be a positive int")
            out.append(g)
            continue
        value = g
        if not isinstance(g, int):  # Python ints (and sizes traced by torch.compile) pass as they are
            try:
                # operator.index takes exactly the integer types (NumPy ints, 0-d integer tensors), not 2.0
                value = operator.index(g)
            except TypeError:
                pass
        out.append(check_int(value, f"{name}[{i}]", min=1, expected="positive", type_expected="an int"))
    return tuple(out)


def is_symbolic_grid(grid_size: Sequence[int]) -> bool:
    """True when an entry of ``grid_size`` is a symbolic size (``torch.SymInt``: ``torch.export`` or ONNX export
    with dynamic height and width), whose value is known only when the exported graph runs.

    Schemes then take the path that holds at every grid: no early return when the grid equals the training grid
    (comparing would fix the traced value), no cache keyed by the grid.

    Example:
        >>> is_symbolic_grid((14, 14))
        False
    """
    return any(isinstance(g, torch.SymInt) for g in grid_size)


def _axis(n: int, mode: str, n_ref: int | None, device) -> torch.Tensor:
    i = torch.arange(n, device=device, dtype=torch.float32)
    if mode == "index":
        return i
    if mode == "centered":
        return i - (n - 1) / 2
    if mode == "normalized":
        return (i + 0.5) / n
    if mode == "normalized_pm1":
        return 2.0 * ((i + 0.5) / n) - 1.0
    return i * (n_ref / n)


def grid_coords(
    grid_size: Sequence[int],
    mode: str = "index",
    ref_grid_size: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Coordinates of the patch tokens of a grid, row-major, in fp32.

    Args:
        grid_size: ``(H, W)`` or ``(T, H, W)``.
        mode: one of ``index``, ``centered``, ``normalized``, ``ref_scaled``, ``normalized_pm1``.
        ref_grid_size: the training grid, required by ``ref_scaled`` (same length as ``grid_size``).
        device: output device.

    Returns:
        ``(N, ndim)`` float32 tensor, columns ``(y, x)`` or ``(t, y, x)``, ``N = prod(grid_size)``.

    Example:
        >>> grid_coords((2, 3))
        tensor([[0., 0.],
                [0., 1.],
                [0., 2.],
                [1., 0.],
                [1., 1.],
                [1., 2.]])
        >>> grid_coords((1, 4), mode="centered")[:, 1]
        tensor([-1.5000, -0.5000,  0.5000,  1.5000])
    """
    grid_size = validate_grid_size(grid_size)
    check_choice(mode, "mode", GRID_COORD_MODES)
    if mode == "ref_scaled":
        if ref_grid_size is None:
            raise ValueError("mode='ref_scaled' needs ref_grid_size (the training grid), got None")
        ref_grid_size = validate_grid_size(ref_grid_size, "ref_grid_size", ndims=(len(grid_size),))
    else:
        ref_grid_size = (None,) * len(grid_size)
    axes = [_axis(n, mode, r, device) for n, r in zip(grid_size, ref_grid_size, strict=True)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(grid_size))


def prefix_mask(num_prefix_tokens: int, num_patches: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(num_prefix_tokens + num_patches,)`` mask, True on prefix (cls/register) tokens.

    Example:
        >>> prefix_mask(1, 3)
        tensor([ True, False, False, False])
    """
    validate_count(num_prefix_tokens, "num_prefix_tokens")
    validate_count(num_patches, "num_patches")
    mask = torch.zeros(num_prefix_tokens + num_patches, dtype=torch.bool, device=device)
    mask[:num_prefix_tokens] = True
    return mask


# -- training-time coordinate augmentation -------------------------------------------------------------------------


def _check_generator(generator: torch.Generator | None) -> torch.Generator | None:
    """``generator`` if it is None (the global RNG) or a CPU ``torch.Generator``: every draw is made on the CPU (a
    few numbers per forward) and moved to the coordinates' device, so a seed gives the same draws on every device."""
    if generator is None:
        return None
    check_instance(generator, "generator", torch.Generator, expected="a torch.Generator or None")
    if generator.device.type != "cpu":
        raise ValueError(
            f"generator must be a CPU torch.Generator (draws are made on the CPU), got one on {generator.device}"
        )
    return generator


def _check_max_grid(max_grid_size: int | Sequence[int], grid_size: tuple[int, ...]) -> tuple[int, ...]:
    """``max_grid_size`` (an int for every axis, or one int per axis) as a tuple with one entry per axis of
    ``grid_size``, each at least the grid's length."""
    if isinstance(max_grid_size, int) and not isinstance(max_grid_size, bool):
        limits = (check_int(max_grid_size, "max_grid_size", min=1),) * len(grid_size)
    else:
        limits = validate_grid_size(max_grid_size, "max_grid_size", ndims=(len(grid_size),))
    if any(n > limit for n, limit in zip(grid_size, limits, strict=True)):
        raise ValueError(
            f"max_grid_size must be at least the grid on every axis (positions are drawn from {{0..L - 1}}), "
            f"got max_grid_size={limits} for grid_size={grid_size}"
        )
    return limits


def randomized_positions(
    grid_size: Sequence[int], max_grid_size: int | Sequence[int], generator: torch.Generator | None = None
) -> tuple[torch.Tensor, ...]:
    """Randomized positions (Ruoss et al., ACL 2023) per axis: a sorted sample without replacement of n_a integers
    from {0..L_a - 1}, one int64 ``(n_a,)`` tensor per axis (in axis order: y, x or t, y, x).

    Args:
        grid_size: the grid, ``(H, W)`` or ``(T, H, W)``.
        max_grid_size: L, the largest position + 1, per axis (an int for every axis); at least the grid.
        generator: a CPU ``torch.Generator``, or None for the global RNG. One ``randperm`` per axis, in axis order.

    Example:
        >>> y, x = randomized_positions((2, 3), 8, generator=torch.Generator().manual_seed(0))
        >>> bool((y.diff() > 0).all() and (x.diff() > 0).all() and x.max() < 8)
        True
    """
    grid_size = validate_grid_size(grid_size)
    limits = _check_max_grid(max_grid_size, grid_size)
    generator = _check_generator(generator)
    return tuple(
        torch.randperm(limit, generator=generator)[:n].sort().values for n, limit in zip(grid_size, limits, strict=True)
    )


def skip_positions(
    grid_size: Sequence[int], max_grid_size: int | Sequence[int], generator: torch.Generator | None = None
) -> tuple[torch.Tensor, ...]:
    """PoSE-style skipped positions (Zhu et al., ICLR 2024) per axis, one int64 ``(n_a,)`` tensor per axis.

    Per axis a: a cut c_a ~ U{1..n_a - 1} splits 0..n_a - 1 into two chunks, and the second is shifted by
    u_a ~ U{0..L_a - n_a}: positions 0..c_a - 1, then c_a + u_a..n_a - 1 + u_a (so the largest is at most L_a - 1).
    An axis of length 1 has one chunk at 0. [visionpe] PoSE's 1D rule with one cut per axis; in 2D the four quadrants
    of the grid move apart.

    Args:
        grid_size: the grid, ``(H, W)`` or ``(T, H, W)``.
        max_grid_size: L per axis (an int for every axis); at least the grid.
        generator: a CPU ``torch.Generator``, or None for the global RNG. Per axis, in axis order: the cut, then
            the shift (``torch.randint``).

    Example:
        >>> y, x = skip_positions((3, 4), (3, 10), generator=torch.Generator().manual_seed(3))
        >>> y, x  # no room to skip on y (L = n); x cut after 2 positions, the rest shifted by 4
        (tensor([0, 1, 2]), tensor([0, 1, 6, 7]))
    """
    grid_size = validate_grid_size(grid_size)
    limits = _check_max_grid(max_grid_size, grid_size)
    generator = _check_generator(generator)
    out = []
    for n, limit in zip(grid_size, limits, strict=True):
        positions = torch.arange(n)
        if n > 1:
            cut = int(torch.randint(1, n, (1,), generator=generator))
            shift = int(torch.randint(0, limit - n + 1, (1,), generator=generator))
            positions[cut:] += shift
        out.append(positions)
    return tuple(out)


def grid_rows(positions: Sequence[torch.Tensor], max_grid_size: Sequence[int]) -> torch.Tensor:
    """Row-major token indices, int64 ``(prod n_a,)``, into a grid of size ``max_grid_size`` of the tokens at the
    per-axis ``positions`` (the product of the axes, row-major as well).

    Example:
        >>> grid_rows((torch.tensor([0, 2]), torch.tensor([1, 3])), (3, 4))
        tensor([ 1,  3,  9, 11])
    """
    if len(positions) != len(max_grid_size):
        raise ValueError(
            f"positions and max_grid_size must have one entry per axis, got {len(positions)} and {len(max_grid_size)}"
        )
    rows = positions[0]
    for axis_positions, limit in zip(positions[1:], max_grid_size[1:], strict=True):
        rows = (rows[:, None] * limit + axis_positions[None, :]).flatten()
    return rows


def randomized_coords(
    grid_size: Sequence[int],
    max_grid_size: int | Sequence[int],
    mode: str = "index",
    ref_grid_size: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Coordinates ``(N, ndim)`` of a grid at randomized positions: the :func:`grid_coords` of a grid of size L
    (``max_grid_size``) in ``mode`` at the rows and columns :func:`randomized_positions` draws.

    Example:
        >>> c = randomized_coords((2, 3), (4, 9), generator=torch.Generator().manual_seed(0))
        >>> c.shape, bool(c[:, 1].reshape(2, 3).diff().gt(0).all())
        (torch.Size([6, 2]), True)
    """
    grid_size = validate_grid_size(grid_size)
    limits = _check_max_grid(max_grid_size, grid_size)
    positions = randomized_positions(grid_size, limits, generator)
    full = grid_coords(limits, mode, ref_grid_size, device)
    return full[grid_rows(positions, limits).to(full.device)]


def skip_coords(
    grid_size: Sequence[int],
    max_grid_size: int | Sequence[int],
    mode: str = "index",
    ref_grid_size: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Coordinates ``(N, ndim)`` of a grid with PoSE-style skips: the :func:`grid_coords` of a grid of size L
    (``max_grid_size``) in ``mode`` at the rows and columns :func:`skip_positions` draws.

    Example:
        >>> skip_coords((2, 3), (2, 8), generator=torch.Generator().manual_seed(1))[:3, 1]  # x of the first row
        tensor([0., 3., 4.])
    """
    grid_size = validate_grid_size(grid_size)
    limits = _check_max_grid(max_grid_size, grid_size)
    positions = skip_positions(grid_size, limits, generator)
    full = grid_coords(limits, mode, ref_grid_size, device)
    return full[grid_rows(positions, limits).to(full.device)]


def _check_shift_jitter_rescale(
    shift: float | None, jitter: float | None, rescale: float | None
) -> tuple[float | None, float | None, float | None]:
    return (
        None if shift is None else check_float(shift, "shift", min=0),
        None if jitter is None else check_float(jitter, "jitter", min=1, expected="a finite factor >= 1"),
        None if rescale is None else check_float(rescale, "rescale", min=1, expected="a finite factor >= 1"),
    )


def shift_jitter_rescale(
    coords: torch.Tensor,
    shift: float | None = None,
    jitter: float | None = None,
    rescale: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """DINOv3's training-time coordinate augmentation (Siméoni et al., "DINOv3", arXiv 2508.10104, 2025), in its
    order, each step only when its option is set:

    1. shift: c_a += U(-shift, shift), one draw per axis;
    2. jitter: c_a *= exp(U(-ln jitter, ln jitter)), one draw per axis;
    3. rescale: c *= exp(U(-ln rescale, ln rescale)), one draw shared by every axis.

    Args:
        coords: ``(..., ndim)`` floating-point coordinates (the last dim holds the axes).
        shift: the shift bound s >= 0, in the coordinates' units, or None.
        jitter: the per-axis factor bound J >= 1, or None.
        rescale: the shared factor bound S >= 1, or None.
        generator: a CPU ``torch.Generator``, or None for the global RNG. The draws are fp32 ``uniform_`` on the
            CPU, ndim, ndim and 1 numbers, in the order above (DINOv3's ``RopePositionEmbedding.forward``).

    Returns:
        A new tensor like ``coords``.

    Example:
        >>> c = torch.tensor([[-0.5, 0.5]])
        >>> out = shift_jitter_rescale(c, rescale=2.0, generator=torch.Generator().manual_seed(0))
        >>> bool(torch.allclose(out / c, (out / c)[0, 0]))  # one factor for both axes
        True
    """
    if not isinstance(coords, torch.Tensor) or not coords.is_floating_point() or coords.ndim < 1:
        raise TypeError(f"coords must be a floating-point (..., ndim) tensor, got {describe(coords)}")
    shift, jitter, rescale = _check_shift_jitter_rescale(shift, jitter, rescale)
    generator = _check_generator(generator)
    ndim = coords.shape[-1]
    if shift is not None:
        draw = torch.empty(ndim, dtype=torch.float32).uniform_(-shift, shift, generator=generator)
        coords = coords + draw.to(coords)
    if jitter is not None:
        bound = math.log(jitter)
        draw = torch.empty(ndim, dtype=torch.float32).uniform_(-bound, bound, generator=generator).exp()
        coords = coords * draw.to(coords)
    if rescale is not None:
        bound = math.log(rescale)
        draw = torch.empty(1, dtype=torch.float32).uniform_(-bound, bound, generator=generator).exp()
        coords = coords * draw.to(coords)
    return coords


@dataclass(frozen=True)
class CoordAugment:
    """A training-time coordinate augmentation: how a training forward draws its patch coordinates.

    Set it on a model with :func:`~visionpe.base.set_coord_augment` (or ``timm.create_model(...,
    coord_augment=...)``): every scheme that reads coordinates (rotary schemes, the distance biases ``alibi2d``,
    ``kerple_*``, ``bam`` and ``lookhere``, the absolute ``sincos`` and ``fourier``) draws its coordinates through
    it in training mode, once per forward, shared by the images of the batch (as DINOv3 draws them). In eval mode
    nothing is drawn: the outputs are those of the model without augmentation, bit for bit.

    Args:
        kind: ``"randomized"`` (Ruoss et al., ACL 2023), ``"pose"`` (Zhu et al., ICLR 2024) or ``"dinov3"``
            (Siméoni et al., arXiv 2508.10104); see the module docstring.
        max_grid_size: ``randomized`` and ``pose``: L, the size of the grid the positions are drawn from (an int
            for every axis, or one per axis), at least the training grid; typically the largest test grid. The
            coordinates are those the scheme gives that grid at the drawn rows and columns, in its own coordinate
            mode (so ``normalized`` coordinates are divided by L).
        shift, jitter, rescale: ``dinov3``: the bounds of :func:`shift_jitter_rescale` (s >= 0 in the scheme's
            coordinate units, J >= 1, S >= 1); at least one is set. DINOv3 released rescale=2 alone, on
            coordinates in (-1, 1).
        generator: a CPU ``torch.Generator`` the draws come from, or None for the global RNG (``torch.manual_seed``).

    A dict with these keys is accepted wherever a ``CoordAugment`` is (configuration files).

    Example:
        >>> aug = CoordAugment("randomized", max_grid_size=(32, 32))
        >>> coords = aug.apply(grid_coords, (3, 5))
        >>> coords.shape, bool((coords[:, 0].reshape(3, 5)[:, 0].diff() > 0).all())
        (torch.Size([15, 2]), True)
    """

    kind: str
    max_grid_size: int | tuple[int, ...] | None = None
    shift: float | None = None
    jitter: float | None = None
    rescale: float | None = None
    generator: torch.Generator | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_choice(self.kind, "kind", COORD_AUGMENT_KINDS)
        dinov3 = {"shift": self.shift, "jitter": self.jitter, "rescale": self.rescale}
        if self.kind == "dinov3":
            if self.max_grid_size is not None:
                raise ValueError(
                    f"max_grid_size applies to kind='randomized' or 'pose', got max_grid_size={self.max_grid_size!r} "
                    "with kind='dinov3'"
                )
            if all(v is None for v in dinov3.values()):
                raise ValueError("kind='dinov3' needs at least one of shift, jitter, rescale, got none of them")
            checked = _check_shift_jitter_rescale(self.shift, self.jitter, self.rescale)
            for name, value in zip(dinov3, checked, strict=True):
                object.__setattr__(self, name, value)
        else:
            for name, value in dinov3.items():
                if value is not None:
                    raise ValueError(
                        f"{name} applies to kind='dinov3' only, got {name}={value!r} with kind={self.kind!r}"
                    )
            if self.max_grid_size is None:
                raise ValueError(
                    f"kind={self.kind!r} needs max_grid_size (L: positions are drawn from {{0..L - 1}} per axis), "
                    "got None"
                )
            if isinstance(self.max_grid_size, int) and not isinstance(self.max_grid_size, bool):
                check_int(self.max_grid_size, "max_grid_size", min=1)
            else:
                limits = validate_grid_size(self.max_grid_size, "max_grid_size")
                object.__setattr__(self, "max_grid_size", limits)
        _check_generator(self.generator)

    @classmethod
    def from_value(cls, value: CoordAugment | Mapping[str, Any] | None, name: str = "coord_augment"):
        """``value`` as a :class:`CoordAugment` (a dict of its fields is converted), or None for None; TypeError
        naming ``name`` for anything else or a dict with unknown keys.

        Example:
            >>> CoordAugment.from_value({"kind": "dinov3", "rescale": 2})
            CoordAugment(kind='dinov3', max_grid_size=None, shift=None, jitter=None, rescale=2.0)
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = [f.name for f in fields(cls)]
            unknown = [k for k in value if k not in known]
            if unknown:
                raise TypeError(f"{name} got unknown key(s) {unknown}; valid keys: {known}")
            if "kind" not in value:
                raise TypeError(f"{name} must name its kind ({', '.join(COORD_AUGMENT_KINDS)}), got keys {list(value)}")
            return cls(**value)
        raise TypeError(f"{name} must be a CoordAugment, a dict of its fields or None, got {describe(value)}")

    def apply(self, coords_fn: Callable[[tuple[int, ...]], torch.Tensor], grid_size: Sequence[int]) -> torch.Tensor:
        """One draw of the augmented coordinates of ``grid_size``.

        Args:
            coords_fn: the scheme's coordinate builder: a grid size -> its coordinates, row-major, first dim the
                tokens and last dim the axes (``(N, ndim)``, or ``(N, G, ndim)`` for Fourier features' corners).
            grid_size: the grid of the forward.

        Returns:
            ``randomized`` / ``pose``: the rows of ``coords_fn(max_grid_size)`` at the drawn positions;
            ``dinov3``: :func:`shift_jitter_rescale` of ``coords_fn(grid_size)``.
        """
        grid_size = validate_grid_size(grid_size)
        if self.kind == "dinov3":
            return shift_jitter_rescale(coords_fn(grid_size), self.shift, self.jitter, self.rescale, self.generator)
        limits = _check_max_grid(self.max_grid_size, grid_size)
        draw = randomized_positions if self.kind == "randomized" else skip_positions
        positions = draw(grid_size, limits, self.generator)
        full = coords_fn(limits)
        return full[grid_rows(positions, limits).to(full.device)]


@dataclass(frozen=True)
class MixedGrid:
    """The per-sample layout of a mixed-resolution batch (timm's NaFlex convention), built by :func:`mixed_grid`.

    Sample ``b`` is the grid ``grid_sizes[b]``; its ``lengths[b] = prod(grid_sizes[b])`` patches are the first tokens
    of its row, in raster order (token ``k`` at ``(k // W, k % W)`` in 2D), padding after. ``groups`` lists each
    distinct grid once, in order of first appearance, with the int64 indices of the samples at that grid (on the
    device of the coordinates): a scheme whose positions depend on the grid is computed once per group.

    Attributes:
        patch_coord: (B, N, ndim) int64 patch indices, as given.
        patch_valid: (B, N) bool, True on the patches of each sample's grid.
        grid_sizes: one grid size per sample.
        lengths: valid patches per sample.
        groups: ``((grid_size, sample_indices), ...)``.
    """

    patch_coord: torch.Tensor
    patch_valid: torch.Tensor
    grid_sizes: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], torch.Tensor], ...]

    @property
    def batch_size(self) -> int:
        """B, the number of samples."""
        return len(self.grid_sizes)

    @property
    def num_patches(self) -> int:
        """N, the padded number of patch tokens per sample."""
        return self.patch_valid.shape[1]

    @property
    def is_uniform(self) -> bool:
        """True when every sample has the same grid and no padding: the batch is an ordinary one-grid batch."""
        return len(self.groups) == 1 and self.lengths[0] == self.num_patches


def _first_samples(flags: torch.Tensor, limit: int = 4) -> list[int]:
    """Indices of the first ``limit`` True entries of a (B,) bool tensor, for error messages."""
    return flags.nonzero().flatten()[:limit].tolist()


def mixed_grid(patch_coord: torch.Tensor, patch_valid: torch.Tensor, ndims: Sequence[int] = (2,)) -> MixedGrid:
    """Validate a mixed-resolution batch's patch coordinates and validity mask; return its :class:`MixedGrid`.

    Each sample's grid is read off its valid patches: ``max coordinate + 1`` per axis. The valid patches must be that
    whole grid in raster order, before any padding (the layout timm's ``Patchify`` and ``NaFlexCollator`` produce),
    and a padding entry's coordinate must lie inside its sample's grid (timm's collator writes zeros there; timm's
    ``NaFlexVit`` reads the grid off every entry, padding included).

    Args:
        patch_coord: (B, N, ndim) integer tensor, the (y, x) (or (t, y, x)) index of each patch.
        patch_valid: (B, N) bool tensor (or integer 0 / 1), True on real patches.
        ndims: the allowed numbers of axes.

    Returns:
        The batch's :class:`MixedGrid`.

    Raises:
        TypeError: a non-tensor, a floating-point ``patch_coord`` or a ``patch_valid`` that is not bool or 0 / 1.
        ValueError: wrong shapes, a sample with no valid patch, padding before a valid patch, a negative coordinate,
            valid patches that are not their grid in raster order, or a padding coordinate outside its sample's grid.

    Example:
        >>> coord = torch.tensor([[[0, 0], [0, 1], [0, 0]], [[0, 0], [1, 0], [2, 0]]])
        >>> valid = torch.tensor([[True, True, False], [True, True, True]])
        >>> layout = mixed_grid(coord, valid)
        >>> layout.grid_sizes, layout.lengths
        (((1, 2), (3, 1)), (2, 3))
    """
    if not isinstance(patch_coord, torch.Tensor):
        raise TypeError(f"patch_coord must be a (B, N, ndim) integer tensor, got {describe(patch_coord)}")
    if not isinstance(patch_valid, torch.Tensor):
        raise TypeError(f"patch_valid must be a (B, N) bool tensor, got {describe(patch_valid)}")
    if patch_coord.is_floating_point() or patch_coord.is_complex() or patch_coord.dtype == torch.bool:
        raise TypeError(
            f"patch_coord must hold integer patch indices (int64, as timm's collator gives), got {patch_coord.dtype}"
        )
    if patch_coord.ndim != 3 or patch_coord.shape[2] not in tuple(ndims) or 0 in patch_coord.shape[:2]:
        raise ValueError(
            f"patch_coord must have shape (B, N, ndim) with B, N >= 1 and ndim in {tuple(ndims)}, got shape "
            f"{tuple(patch_coord.shape)}"
        )
    if tuple(patch_valid.shape) != tuple(patch_coord.shape[:2]):
        raise ValueError(
            f"patch_valid must have shape (B, N) = {tuple(patch_coord.shape[:2])}, as patch_coord, got shape "
            f"{tuple(patch_valid.shape)}"
        )
    if patch_valid.dtype != torch.bool:
        binary = not patch_valid.is_floating_point() and not patch_valid.is_complex()
        if not binary or not bool(((patch_valid == 0) | (patch_valid == 1)).all()):
            raise TypeError(f"patch_valid must be a bool (or 0 / 1 integer) tensor, got dtype {patch_valid.dtype}")
        patch_valid = patch_valid.bool()
    patch_valid = patch_valid.to(patch_coord.device)
    coord = patch_coord.long()
    counts = patch_valid.sum(1)
    empty = counts == 0
    if bool(empty.any()):
        raise ValueError(
            f"patch_valid must mark at least one valid patch in every sample, got none in sample(s) "
            f"{_first_samples(empty)}"
        )
    position = torch.arange(coord.shape[1], device=coord.device)
    first = position[None, :] < counts[:, None]  # (B, N): the first `count` tokens of each sample
    disordered = (first != patch_valid).any(1)
    if bool(disordered.any()):
        raise ValueError(
            "patch_valid must list each sample's valid patches first and its padding after (timm's NaFlex layout), "
            f"got padding before a valid patch in sample(s) {_first_samples(disordered)}"
        )
    valid_coord = coord.masked_fill(~patch_valid[..., None], 0)
    negative = (valid_coord < 0).any(2).any(1)
    if bool(negative.any()):
        raise ValueError(
            f"patch_coord must be non-negative patch indices, got a negative coordinate in sample(s) "
            f"{_first_samples(negative)}"
        )
    sizes = valid_coord.amax(1) + 1  # (B, ndim)
    spans = sizes.prod(1)
    incomplete = spans != counts
    if bool(incomplete.any()):
        b = _first_samples(incomplete, 1)[0]
        raise ValueError(
            f"patch_coord must give each sample's valid patches as its whole grid: sample {b} has {int(counts[b])} "
            f"valid patches but its coordinates span a {'x'.join(map(str, sizes[b].tolist()))} grid "
            f"({int(spans[b])} patches)"
        )
    # raster order: token k of sample b sits at the row-major index k of its grid
    expected, rest = [], position[None, :].expand(coord.shape[0], -1)
    for axis in reversed(range(coord.shape[2])):
        expected.append(rest % sizes[:, axis : axis + 1])
        rest = rest // sizes[:, axis : axis + 1]
    expected = torch.stack(expected[::-1], dim=-1)
    misplaced = ((coord != expected).any(2) & patch_valid).any(1)
    if bool(misplaced.any()):
        b = _first_samples(misplaced, 1)[0]
        k = int(((coord[b] != expected[b]).any(1) & patch_valid[b]).nonzero()[0])
        raise ValueError(
            f"patch_coord must list each sample's valid patches in raster order of its grid: sample {b} "
            f"({'x'.join(map(str, sizes[b].tolist()))} grid) has {tuple(coord[b, k].tolist())} at patch {k}, expected "
            f"{tuple(expected[b, k].tolist())}"
        )
    outside = (((coord < 0) | (coord >= sizes[:, None, :])).any(2) & ~patch_valid).any(1)
    if bool(outside.any()):
        b = _first_samples(outside, 1)[0]
        k = int((((coord[b] < 0) | (coord[b] >= sizes[b])).any(1) & ~patch_valid[b]).nonzero()[0])
        raise ValueError(
            f"patch_coord at padding (patch_valid False) must lie inside the sample's grid, as timm's collator writes "
            f"zeros there: sample {b} ({'x'.join(map(str, sizes[b].tolist()))} grid) has {tuple(coord[b, k].tolist())} "
            f"at padding patch {k}"
        )
    grid_sizes = tuple(tuple(row) for row in sizes.tolist())
    members: dict[tuple[int, ...], list[int]] = {}
    for b, grid in enumerate(grid_sizes):
        members.setdefault(grid, []).append(b)
    groups = tuple((grid, torch.tensor(index, device=coord.device)) for grid, index in members.items())
    return MixedGrid(coord, patch_valid, grid_sizes, tuple(counts.tolist()), groups)
