"""Learned functions of 2D distance as attention biases: the shared machinery of KERPLE and BAM.

The 1D papers bias a (query, key) pair by a learned kernel of |m - n|. On an image grid the distance between
patches p_i and p_j is one of (``distance=``):

- ``"euclidean"`` (default): ||p_i - p_j||_2, isotropic, as 2D ALiBi and LookHere measure it;
- ``"manhattan"``: |dy| + |dx|;
- ``"axis"``: the kernel applied to |dy| and to |dx| with separate parameters per axis, and the two summed.

Every distance depends on the offset p_i - p_j only, so the per-forward state keeps one value per grid offset
(:class:`~visionpe.bias.offsets.OffsetState`) and each block gathers the rows it needs; nothing of size (N, N) is
kept, and a larger grid recomputes its distances (nothing is resampled). Pairs involving a prefix token (cls,
registers) get the kernel's value at distance 0: zero for KERPLE and ALiBi, and a per-head constant for BAM, which
the softmax cancels.

In training with a coordinate augmentation (``coord_augment``, :class:`~visionpe.grid.CoordAugment`) the drawn
coordinates are no function of the grid offset, so the state keeps them instead (:class:`CoordinateState`, O(N))
and each block computes the distances of the query rows it asks for from them (:func:`coordinate_distances`);
evaluation keeps the per-offset tables.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from ..base import BiasPositionEncoding, check_layer, check_model_shape
from ..checks import check_choice
from .offsets import OffsetBias, OffsetState, gather_offsets, offset_state, query_rows

_T = TypeVar("_T")

__all__ = [
    "DISTANCES",
    "AxisDistanceState",
    "CoordinateState",
    "DistanceKernelBias",
    "axis_distances",
    "coordinate_distances",
]

DISTANCES = ("euclidean", "manhattan", "axis")


@dataclass
class AxisDistanceState(OffsetState):
    """:class:`~visionpe.bias.offsets.OffsetState` with ``table``: fp32 (A, K + 1) distances per grid offset, one
    row per distance group (A = 2 for ``"axis"``: |dy| and |dx|; else 1), 0 in the prefix entry K."""

    table: torch.Tensor | None = None


def axis_distances(state: OffsetState, distance: str) -> torch.Tensor:
    """fp32 (A, K + 1) distances of every grid offset of ``state`` (see the module docstring), prefix entry 0.

    Example:
        >>> from visionpe.bias.offsets import offset_state
        >>> axis_distances(offset_state((1, 2), 0, None, 0), "manhattan")
        tensor([[1., 0., 1., 0.]])
    """
    check_choice(distance, "distance", DISTANCES)
    dy, dx = (d.abs().flatten() for d in state.offsets())
    if distance == "euclidean":
        # sqrt of the exact integer sum of squares, as 2D ALiBi's distances
        rows = dy.square().add(dx.square()).sqrt()[None]
    elif distance == "manhattan":
        rows = (dy + dx)[None]
    else:
        rows = torch.stack((dy, dx))
    return torch.cat((rows, rows.new_zeros(len(rows), 1)), 1)


@dataclass
class CoordinateState:
    """Per-forward state of a distance bias whose patch coordinates were drawn by a training-time ``coord_augment``:
    ``coords`` (N, ndim) fp32, row-major, after ``num_prefix_tokens`` prefix tokens that have no position."""

    coords: torch.Tensor
    num_prefix_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.coords.shape[0]

    def visit(self, offsets: Callable[[OffsetState], _T], coordinates: Callable[[CoordinateState], _T]) -> _T:
        """``coordinates(self)``: drawn coordinates, no grid offsets (see :meth:`OffsetState.visit`)."""
        return coordinates(self)

    def offsets(self, rows: slice | None = None) -> torch.Tensor:
        """p_i - p_j, fp32 (ndim, R, P + N) for the query ``rows`` (all rows for None), 0 for pairs with a prefix
        token."""
        n, p = self.num_tokens, self.num_prefix_tokens
        selected = query_rows(rows, n)
        queries = self.coords[max(selected.start, p) - p : max(selected.stop, p) - p]
        diff = (queries[:, None, :] - self.coords[None, :, :]).permute(2, 0, 1)
        return F.pad(diff, (p, 0, len(selected) - len(queries), 0))


def _no_terms(state: CoordinateState) -> None:
    """Drawn coordinates have no per-offset terms for fused attention."""
    return None


def coordinate_distances(state: CoordinateState, distance: str, rows: slice | None = None) -> torch.Tensor:
    """fp32 (A, R, P + N) distances between the coordinates of ``state`` for the query ``rows``, computed as
    :func:`axis_distances` computes them per grid offset (the same values at grid coordinates); 0 for prefix pairs."""
    check_choice(distance, "distance", DISTANCES)
    dy, dx = state.offsets(rows).abs().unbind(0)
    if distance == "euclidean":
        return dy.square().add(dx.square()).sqrt()[None]
    if distance == "manhattan":
        return (dy + dx)[None]
    return torch.stack((dy, dx))


class DistanceKernelBias(BiasPositionEncoding):
    """Base class of biases b_h(i, j) = sum_a f_{l, a, h}(d_a(i, j)), a learned kernel of the distance.

    Subclasses implement :meth:`kernel`. Parameters live in one tensor per kernel parameter of shape
    (depth, A, num_heads) (A = 2 for ``distance="axis"``, else 1): one kernel per block, as the 1D papers give
    each layer its own.
    """

    ndims = (2,)
    attention_backends = ("sdpa", "flex")  # per-offset terms for FlexAttention (fused_bias)
    # torch.onnx's decomposition of an attention with a bias computed from parameters fails on a view (torch 2.14)
    onnx_refusal = "torch.onnx fails to decompose the attention with a bias computed from parameters"
    batch_shared_bias = True  # a function of the positions only
    consumes_coords = True  # index coordinates; a training-time coord_augment draws them (CoordinateState)
    #: grids up to this many tokens cache their full (N, N) offset index per forward (4 MB at 1024 tokens)
    full_state_max_tokens: int = 1024

    def __init__(self, dim: int, num_heads: int, depth: int = 1, distance: str = "euclidean") -> None:
        super().__init__()
        check_model_shape(dim, num_heads, depth)
        self.distance = check_choice(distance, "distance", DISTANCES)
        self.num_heads, self.depth = num_heads, depth
        self.num_axes = 2 if distance == "axis" else 1

    @abstractmethod
    def kernel(self, distances: torch.Tensor, layer: int) -> torch.Tensor:
        """(A, h, K + 1) bias values of block ``layer`` at ``distances`` (A, 1, K + 1), in their dtype."""

    def prepare(
        self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None
    ) -> AxisDistanceState | CoordinateState:
        """Distances per grid offset for the current grid (and the full offset index when the grid is small); in
        training with ``coord_augment``, the drawn coordinates."""
        if self.training and self.coord_augment is not None:
            return CoordinateState(self.forward_coords(self.check_grid(grid_size), device), num_prefix_tokens)
        base = offset_state(self.check_grid(grid_size), num_prefix_tokens, device, self.full_state_max_tokens)
        table = axis_distances(base, self.distance)
        return AxisDistanceState(base.grid_size, base.num_prefix_tokens, base.device, base.index, table)

    def offset_table(self, state: AxisDistanceState, layer: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(h, K + 1) bias of block ``layer`` per grid offset (the prefix entry last), computed in fp32 (fp64 for
        fp64 ``dtype``) and rounded once to ``dtype``."""
        compute = torch.promote_types(dtype, torch.float32)
        with torch.autocast(state.table.device.type, enabled=False):
            values = self.kernel(state.table.to(compute)[:, None], layer).sum(0)
        return values.to(dtype)

    def attn_bias(
        self, q: torch.Tensor, k: torch.Tensor, state: AxisDistanceState, layer: int, rows: slice | None = None
    ) -> torch.Tensor:
        """The kernel's bias, ``(1, h, R, P + N)`` in the dtype of q; R = P + N or the query ``rows``."""
        n = state.num_tokens
        num_rows = len(query_rows(rows, n))
        if q.shape[-2] != num_rows or k.shape[-2] != n or q.shape[1] != self.num_heads:
            raise ValueError(
                f"q and k must have shape (B, {self.num_heads}, {num_rows}, head_dim) and "
                f"(B, {self.num_heads}, {n}, head_dim) for this grid, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )

        def per_offset(state: AxisDistanceState) -> torch.Tensor:
            table = self.offset_table(state, layer, q.dtype)
            return gather_offsets(table, state.offset_index(query_rows(rows, n), range(n)))[None]

        def drawn(state: CoordinateState) -> torch.Tensor:  # the kernel of each pair's distances
            distances = coordinate_distances(state, self.distance, rows)
            compute = torch.promote_types(q.dtype, torch.float32)
            with torch.autocast(distances.device.type, enabled=False):
                values = self.kernel(distances.to(compute).flatten(1)[:, None], layer).sum(0)
            return values.unflatten(-1, distances.shape[1:]).to(q.dtype)[None]

        return state.visit(per_offset, drawn)

    def fused_bias(
        self, q: torch.Tensor, k: torch.Tensor, state: AxisDistanceState, layer: int
    ) -> list[OffsetBias] | None:
        """The kernel's bias per grid offset for fused attention (None for drawn coordinates, no grid offset)."""
        return state.visit(lambda s: [OffsetBias(s, self.offset_table(s, layer, q.dtype)[None, :, None])], _no_terms)

    def kernel_parameter(self, init: torch.Tensor | float = 0.0, *, uniform: float | None = None) -> torch.Tensor:
        """A (depth, A, num_heads) kernel parameter: ``init`` everywhere, or U(0, ``uniform``) draws."""
        shape = (self.depth, self.num_axes, self.num_heads)
        return (
            torch.rand(shape) * uniform if uniform is not None else torch.as_tensor(init).float().expand(shape).clone()
        )

    def layer_parameter(self, param: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """(A, h, 1) slice of a (depth, A, h) parameter for block ``layer``, in ``dtype``."""
        check_layer(layer, self.depth, type(self).__name__)
        return param[layer][..., None].to(dtype)

    def no_weight_decay(self) -> set[str]:
        """Every kernel parameter: they set how fast attention decays with distance, as ALiBi's fixed slopes do."""
        return {name for name, _ in self.named_parameters(recurse=False)}
