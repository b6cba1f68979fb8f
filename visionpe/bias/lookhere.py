"""LookHere: Fuller et al., "LookHere: Vision Transformers with Directed Attention Generalize and
Extrapolate", NeurIPS 2024.

A^l = softmax(QK^T / sqrt(d) - M^l), M^l_{h,i,j} = s_g s_l(l) s_h(h) ||p_i - p_j||_2 if j is in head h's field
of view from i, +inf otherwise; no PE is added. Directed heads look in one direction (LH-180 half-planes,
LH-90 quadrants, LH-45 octants), undirected heads see everything. s_l = linspace(1.5, 0.5, depth); directed
s_h = 1/2 (cardinal) or 1/4 (intercardinal). Prefix rows and columns are 0.

Memory: whether j is in head h's view from i, and ||p_i - p_j||, depend only on the offset p_i - p_j, so the
per-forward state is one (h, (2H - 1)(2W - 1)) table: the distance, or +inf outside the view. Each block scales
it by its slopes in fp32, rounds it once to the activation dtype, and gathers the bias of the query rows it needs
(all rows, or one chunk when attention runs in query chunks), so a large grid never holds an (N, N) map. Small grids
(``full_state_max_tokens``) cache the full (N, N) offset index. Nothing is precomputed per layer or resolution.
In training with a ``coord_augment`` (:class:`~visionpe.grid.CoordAugment`) the views and distances of each block's
query rows are computed from the drawn coordinates instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..base import BiasPositionEncoding, check_layer, check_model_shape
from ..checks import check_choice, check_float, check_int, check_positive, is_number
from ..grid import grid_coords, validate_grid_size
from ..registry import register_scheme
from .distance import CoordinateState
from .offsets import (
    GlobalSlope,
    OffsetBias,
    OffsetState,
    distance_state,
    gather_offsets,
    query_rows,
    span_length,
)

__all__ = ["LookHere", "LookHereState", "LOOKHERE_VARIANTS", "lookhere_heads", "lookhere_fov_masks"]

LOOKHERE_VARIANTS = ("180", "90", "45")
# view directions in degrees, x to the right and y down (90 = down): cardinal first, then intercardinal
_DIRECTIONS = {
    "180": (0.0, 90.0, 180.0, 270.0, 45.0, 135.0, 225.0, 315.0),
    "90": (0.0, 90.0, 180.0, 270.0, 45.0, 135.0, 225.0, 315.0),
    # the four cardinal LH-90 quadrants, each cut in two: eight octants that tile the plane
    "45": (-22.5, 22.5, 67.5, 112.5, 157.5, 202.5, 247.5, 292.5),
}
_UNDIRECTED_SLOPES = {"paper": 0.5, "released": 0.25}  # first slope; each next one is a quarter of it


def lookhere_heads(
    num_heads: int, variant: str = "180", undirected_slopes: str = "paper"
) -> tuple[list[float | None], list[float]]:
    """Per-head view direction (degrees, None for undirected) and slope s_h.

    ViT-B (12 heads): 8 directed (4 cardinal with s_h = 1/2, 4 intercardinal with 1/4) and 4 undirected with
    (1/2, 1/8, 1/32, 1/128) (``paper``) or (1/4, 1/16, 1/64, 1/256) (``released``). [visionpe] Other head
    counts keep the 2:1 ratio: round(2h/3) directed heads, taking the directions in the order above and
    cycling past 8, and the undirected slopes continue the geometric sequence.

    Example:
        >>> directions, slopes = lookhere_heads(6)
        >>> directions, slopes
        ([0.0, 90.0, 180.0, 270.0, None, None], [0.5, 0.5, 0.5, 0.5, 0.5, 0.125])
    """
    check_int(num_heads, "num_heads", min=1)
    check_choice(variant, "LookHere variant", LOOKHERE_VARIANTS)
    check_choice(undirected_slopes, "undirected_slopes", tuple(_UNDIRECTED_SLOPES))
    num_directed = round(2 * num_heads / 3)
    directions: list[float | None] = [_DIRECTIONS[variant][h % 8] for h in range(num_directed)]
    slopes = [0.5 if h % 8 < 4 else 0.25 for h in range(num_directed)]
    first = _UNDIRECTED_SLOPES[undirected_slopes]
    for u in range(num_heads - num_directed):
        directions.append(None)
        slopes.append(first * 0.25**u)
    return directions, slopes


def _unit(degrees: float) -> tuple[float, float]:
    """(x, y) direction scaled so that multiples of 45 degrees are exact small integers."""
    x, y = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    largest = max(abs(x), abs(y))
    return round(x / largest, 12), round(y / largest, 12)


def _fov_mask(dy: torch.Tensor, dx: torch.Tensor, direction: float | None, fov: float) -> torch.Tensor:
    """One head's view from offsets p_j - p_i (dy, dx), bool, boundary rays included."""
    if direction is None or fov >= 360:
        return torch.ones_like(dy, dtype=torch.bool)
    if fov == 180:
        ux, uy = _unit(direction)
        return (dx * ux + dy * uy >= 0) | ((dy == 0) & (dx == 0))  # j = i is always in view, boundary rays included
    # a sector between two rays: counter-clockwise of the first, clockwise of the second (y down). With the
    # default views the rays are axes or diagonals, so on integer offsets both tests are exact.
    ax, ay = _unit(direction - fov / 2)
    bx, by = _unit(direction + fov / 2)
    after_first, before_second = ax * dy - ay * dx >= 0, dx * by - dy * bx >= 0
    inside = after_first & before_second if fov < 180 else after_first | before_second
    return inside | ((dy == 0) & (dx == 0))


def _offsets(grid_size: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    y, x = grid_coords(grid_size, mode="index", device=device).unbind(-1)
    return y[None, :] - y[:, None], x[None, :] - x[:, None]  # (N, N) each: p_j - p_i


def lookhere_fov_masks(
    grid_size: tuple[int, int],
    directions: Sequence[float | None],
    fov: float,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Field-of-view masks, bool ``(len(directions), N, N)``: [h, i, j] is True if j is visible from i.

    j is visible if j = i or the angle between p_j - p_i and the head's direction (degrees, x right, y down)
    is <= fov / 2. Boundary rays are included, so neighbouring views overlap on them and together cover
    every key. A direction of None sees everything.

    Example:
        >>> lookhere_fov_masks((1, 3), [0.0], fov=180.0)[0].int()  # looking right along one row
        tensor([[1, 1, 1],
                [0, 1, 1],
                [0, 0, 1]], dtype=torch.int32)
    """
    grid_size = validate_grid_size(grid_size, ndims=(2,))
    fov = _check_fov(fov)
    _check_directions(directions)
    dy, dx = _offsets(grid_size, device)
    return torch.stack([_fov_mask(dy, dx, d, fov) for d in directions])


def _check_directions(directions: Sequence[float | None]) -> None:
    if not isinstance(directions, (list, tuple)) or not all(d is None or is_number(d) for d in directions):
        raise ValueError(f"directions must be a list of angles in degrees or None, got {directions!r}")
    for h, d in enumerate(directions):
        if d is not None:
            check_float(d, f"directions[{h}]", expected="a finite angle in degrees (or None)")


def _check_fov(fov: float) -> float:
    return check_float(fov, "fov", min=0, max=360, min_open=True, expected="a number of degrees in (0, 360]")


@dataclass
class LookHereState(OffsetState):
    """Per-forward LookHere state for one grid (see :class:`~visionpe.bias.offsets.OffsetState`).

    ``penalty``: fp32 (h, K + 1), per grid offset ||p_i - p_j|| on ``index`` coordinates, or +inf where the key
    is outside head h's view from the query; 0 for pairs that involve a prefix token.
    """

    penalty: torch.Tensor | None = None


@register_scheme("lookhere")
class LookHere(GlobalSlope, BiasPositionEncoding):
    """LookHere directed attention masks with distance penalties, built per forward for the current grid.

    Args:
        dim, num_heads, depth: model shape.
        variant: ``"180"`` (default), ``"90"`` or ``"45"``: the field of view of the directed heads.
        global_slope: s_g, a test-time knob (published 1.0/1.0/0.95/0.95/0.95/0.75/0.6 at
            224/320/384/448/512/768/1024 px); change it on a trained model with ``scheme.global_slope = 0.95``.
        layer_slopes: (first, last) of s_l = linspace(first, last, depth).
        undirected_slopes: ``paper`` (1/2, 1/8, ...) or ``released`` (1/4, 1/16, ...), the released code's values.
        directions, head_slopes: per-head view directions (degrees, x right, y down; None for an undirected head)
            and slopes s_h, one per head, in place of the defaults of :func:`lookhere_heads`: a checkpoint's own
            head layout (e.g. LH-90 trained with s_h = 1/2 for every directed head, or another head order) is
            reproduced by passing its config. Either may be given alone.
    """

    ndims = (2,)
    attention_backends = ("sdpa", "flex")  # per-offset terms for FlexAttention (fused_bias)
    batch_shared_bias = True  # a function of the positions only
    consumes_coords = True  # index coordinates; a training-time coord_augment draws them (CoordinateState)
    # grids up to this many tokens cache their full int32 offset index per forward (4 MB at 1024 tokens)
    full_state_max_tokens: int = 1024

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        variant: str = "180",
        global_slope: float = 1.0,
        layer_slopes: tuple[float, float] = (1.5, 0.5),
        undirected_slopes: str = "paper",
        directions: Sequence[float | None] | None = None,
        head_slopes: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        check_model_shape(dim, num_heads, depth)
        self.variant = variant
        self.directions, slopes = lookhere_heads(num_heads, variant, undirected_slopes)
        if directions is not None:
            if not isinstance(directions, (list, tuple)) or len(directions) != num_heads:
                raise ValueError(f"directions must list one angle (or None) per head, {num_heads}, got {directions!r}")
            _check_directions(directions)
            self.directions = [None if d is None else float(d) for d in directions]
        if head_slopes is not None:
            if not isinstance(head_slopes, (list, tuple)) or len(head_slopes) != num_heads:
                raise ValueError(f"head_slopes must list one slope per head, {num_heads}, got {head_slopes!r}")
            slopes = [check_positive(v, f"head_slopes[{h}]") for h, v in enumerate(head_slopes)]
        self.global_slope = global_slope  # checked by the setter
        if not isinstance(layer_slopes, (tuple, list)) or len(layer_slopes) != 2:
            raise ValueError(f"layer_slopes must be a (first, last) pair, got {layer_slopes!r}")
        first, last = (check_positive(s, f"layer_slopes[{i}]") for i, s in enumerate(layer_slopes))
        self._slopes, self._layer_slope_range, self._depth = tuple(slopes), (first, last), depth
        self.register_buffer("head_slopes", torch.tensor(slopes), persistent=False)
        self.register_buffer("layer_slopes", torch.linspace(first, last, depth), persistent=False)
        self.fov = {"180": 180.0, "90": 90.0, "45": 45.0}[variant]

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        first, last = self._layer_slope_range
        return {"head_slopes": torch.tensor(self._slopes), "layer_slopes": torch.linspace(first, last, self._depth)}

    def prepare(
        self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None
    ) -> LookHereState | CoordinateState:
        """Per-offset penalties for ``grid_size`` (prefix tokens see and are seen by every token); in training with
        ``coord_augment``, the drawn coordinates (each block then builds its rows' views and distances)."""
        grid_size = self.check_grid(grid_size)
        device = torch.device(device) if device is not None else self.head_slopes.device
        if self.training and self.coord_augment is not None:
            return CoordinateState(self.forward_coords(grid_size, device), num_prefix_tokens)
        base = distance_state(grid_size, num_prefix_tokens, device, self.full_state_max_tokens)
        # the table's offsets are p_i - p_j; a view is defined on p_j - p_i
        dy, dx = (-t for t in base.offsets())
        views = [_fov_mask(dy, dx, d, self.fov).flatten() for d in self.directions]
        visible = torch.cat((torch.stack(views), views[0].new_ones(len(views), 1)), dim=1)  # prefix: visible
        penalty = base.table.expand(len(views), -1).masked_fill(~visible, float("inf"))
        return LookHereState(base.grid_size, base.num_prefix_tokens, base.device, base.index, penalty)

    def attn_bias(
        self, q: torch.Tensor, k: torch.Tensor, state: LookHereState, layer: int, rows: slice | None = None
    ) -> torch.Tensor:
        """-M^l for block ``layer``: ``(1, h, R, P + N)`` in the dtype of q; R = P + N or the query ``rows``."""
        heads, n = len(self.directions), state.num_tokens
        selected = query_rows(rows, n)
        num_rows = span_length(selected)
        if q.shape[-2] != num_rows or k.shape[-2] != n or q.shape[1] != heads:
            raise ValueError(
                f"q and k must have shape (B, {heads}, {num_rows}, head_dim) and "
                f"(B, {heads}, {n}, head_dim) for this grid, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        check_layer(layer, self.layer_slopes.numel(), type(self).__name__)

        # slopes and products in fp32 (fp64 for fp64 activations), one rounding to q's dtype at the end: casting the
        # distances and the slopes first rounds three times (the package's precision rule). Scale and round the
        # small table, then gather: the same values as scaling gathered distances, without an fp32 (R, N) block.
        # Outside the view +inf times a negative slope is -inf, which the cast keeps.
        def per_offset(state: LookHereState) -> torch.Tensor:
            table = self._offset_values(state, layer, q.dtype)
            return gather_offsets(table, state.offset_index(selected, query_rows(None, n)))[None]

        def drawn(state: CoordinateState) -> torch.Tensor:  # each pair's view and distance
            compute = torch.promote_types(q.dtype, torch.float32)
            slopes = (-self.global_slope * self.layer_slopes[layer] * self.head_slopes).to(compute)
            dy, dx = (-d for d in state.offsets(rows))  # p_j - p_i, as the views are defined
            views = torch.stack([_fov_mask(dy, dx, d, self.fov) for d in self.directions])
            penalty = dy.square().add(dx.square()).sqrt().expand_as(views).masked_fill(~views, float("inf"))
            return (penalty.to(compute) * slopes[:, None, None]).to(q.dtype)[None]

        return state.visit(per_offset, drawn)

    def _offset_values(self, state: LookHereState, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """(h, K + 1) bias of block ``layer`` per grid offset, -inf outside a head's view, scaled in fp32 (fp64 for
        fp64 ``dtype``) and rounded once to ``dtype``."""
        compute = torch.promote_types(dtype, torch.float32)
        slopes = (-self.global_slope * self.layer_slopes[layer] * self.head_slopes).to(compute)
        return (state.penalty.to(compute) * slopes[:, None]).to(dtype)

    def fused_bias(self, q: torch.Tensor, k: torch.Tensor, state: LookHereState, layer: int) -> list[OffsetBias] | None:
        """The bias per grid offset for fused attention (None for drawn coordinates, which are no grid offset)."""
        check_layer(layer, self.layer_slopes.numel(), type(self).__name__)
        return state.visit(
            lambda s: [OffsetBias(s, self._offset_values(s, layer, q.dtype)[None, :, None])], lambda s: None
        )
