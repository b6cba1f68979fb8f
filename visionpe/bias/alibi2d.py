"""2D ALiBi: Press et al., "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation", ICLR 2022; 2D form from Fuller et al., "CROMA", NeurIPS 2023.

b_h(i, j) = -s_g * m_h * ||p_i - p_j||_2 on ``index`` coordinates, added to the logits; nothing is learned and
prefix rows and columns get 0. Slopes: m_h = 2^(-8h/H) for H = 2^k, otherwise the 2^floor(log2 H) slopes
followed by every other slope of the 2 * 2^floor(log2 H) sequence.

Memory: the per-forward state is one distance per grid offset, (2H - 1)(2W - 1) values; each block gathers the
bias of the query rows it needs (all rows, or one chunk when attention runs in query chunks) through an offset
index built from coordinate differences, after scaling the table in fp32 and rounding it once to the activation
dtype, so a large grid never holds an (N, N) map. Small grids (``full_state_max_tokens``) cache the full (N, N)
int32 index once per forward instead. In training with a ``coord_augment`` (:class:`~visionpe.grid.CoordAugment`)
the drawn coordinates are no function of the offset: each block computes its rows' distances from them.
"""

from __future__ import annotations

import math

import torch

from ..base import BiasPositionEncoding, check_model_shape
from ..checks import check_int
from ..grid import grid_coords, validate_grid_size
from ..registry import register_scheme
from .distance import CoordinateState, coordinate_distances
from .offsets import (
    DistanceState,
    GlobalSlope,
    OffsetBias,
    distance_state,
    gather_offsets,
    query_rows,
    span_length,
)

__all__ = ["Alibi2D", "alibi_slopes", "grid_distances"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes m_h, float32 ``(num_heads,)``.

    Example:
        >>> alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    check_int(num_heads, "num_heads", min=1)

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def grid_distances(
    grid_size: tuple[int, int], num_prefix_tokens: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Euclidean distances ||p_i - p_j|| between ``index`` coordinates, fp32 ``(P + N, P + N)``, prefix 0.

    Example:
        >>> grid_distances((1, 3))
        tensor([[0., 1., 2.],
                [1., 0., 1.],
                [2., 1., 0.]])
    """
    grid_size = validate_grid_size(grid_size, ndims=(2,))
    check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
    coords = grid_coords(grid_size, mode="index", device=device)
    dist = torch.cdist(coords, coords, compute_mode="donot_use_mm_for_euclid_dist")
    return torch.nn.functional.pad(dist, (num_prefix_tokens, 0, num_prefix_tokens, 0))


@register_scheme("alibi2d")
class Alibi2D(GlobalSlope, BiasPositionEncoding):
    """Fixed 2D ALiBi distance penalty.

    Args:
        dim, num_heads, depth: model shape (the bias is the same in every block).
        global_slope: s_g, a test-time knob (LookHere tuned 1.0/1.4/1.4/1.4/1.4/1.5/1.6 at 224...1024 px);
            it can be changed on a trained model (``scheme.global_slope = 1.4``).
    """

    ndims = (2,)
    attention_backends = ("sdpa", "flex")  # per-offset terms for FlexAttention (fused_bias)
    batch_shared_bias = True  # a function of the positions only
    consumes_coords = True  # index coordinates; a training-time coord_augment draws them (CoordinateState)
    # grids up to this many tokens cache their full offset index per forward (4 MB at 1024 tokens)
    full_state_max_tokens: int = 1024

    def __init__(self, dim: int, num_heads: int, depth: int = 1, global_slope: float = 1.0) -> None:
        super().__init__()
        check_model_shape(dim, num_heads, depth)
        self.global_slope = global_slope  # checked by the setter
        self.num_heads = num_heads
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        return {"slopes": alibi_slopes(self.num_heads)}

    def prepare(
        self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None
    ) -> DistanceState | CoordinateState:
        """Distance per grid offset for the current grid (and the full offset index when the grid is small); in
        training with ``coord_augment``, the drawn coordinates (each block then computes its rows' distances)."""
        if self.training and self.coord_augment is not None:
            return CoordinateState(self.forward_coords(self.check_grid(grid_size), device), num_prefix_tokens)
        return distance_state(self.check_grid(grid_size), num_prefix_tokens, device, self.full_state_max_tokens)

    def attn_bias(
        self, q: torch.Tensor, k: torch.Tensor, state: DistanceState, layer: int, rows: slice | None = None
    ) -> torch.Tensor:
        """-s_g m_h ||p_i - p_j||, ``(1, h, R, P + N)`` in the dtype of q; R = P + N or the query ``rows``."""
        n = state.num_tokens
        num_rows = span_length(query_rows(rows, n))
        if q.shape[-2] != num_rows or k.shape[-2] != n or q.shape[1] != self.slopes.numel():
            raise ValueError(
                f"q and k must have shape (B, {self.slopes.numel()}, {num_rows}, head_dim) and "
                f"(B, {self.slopes.numel()}, {n}, head_dim) for this grid, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )

        # slopes and products in fp32 (fp64 for fp64 activations), one rounding to q's dtype at the end: casting the
        # distances and the slopes first rounds three times (the package's precision rule). Scale and round the
        # (h, K + 1) table, then gather: the same values as scaling the gathered distances, without an fp32 (R, N)
        # block.
        def per_offset(state: DistanceState) -> torch.Tensor:
            table = self._offset_values(state, q.dtype)
            return gather_offsets(table, state.offset_index(query_rows(rows, n), query_rows(None, n)))[None]

        def drawn(state: CoordinateState) -> torch.Tensor:  # each pair's distance
            compute = torch.promote_types(q.dtype, torch.float32)
            slopes = (-self.global_slope * self.slopes).to(compute)
            distances = coordinate_distances(state, "euclidean", rows)[0].to(compute)
            return (slopes[:, None, None] * distances).to(q.dtype)[None]

        return state.visit(per_offset, drawn)

    def _offset_values(self, state: DistanceState, dtype: torch.dtype) -> torch.Tensor:
        """(h, K + 1) bias per grid offset, scaled in fp32 (fp64 for fp64 ``dtype``) and rounded once to ``dtype``."""
        compute = torch.promote_types(dtype, torch.float32)
        slopes = (-self.global_slope * self.slopes).to(compute)
        return (slopes[:, None] * state.table.to(compute)).to(dtype)

    def fused_bias(self, q: torch.Tensor, k: torch.Tensor, state: DistanceState, layer: int) -> list[OffsetBias] | None:
        """The bias per grid offset for fused attention (None for drawn coordinates, which are no grid offset)."""
        return state.visit(lambda s: [OffsetBias(s, self._offset_values(s, q.dtype)[None, :, None])], lambda s: None)
