"""Per-offset state shared by the relative bias schemes (iRPE, LookHere, 2D ALiBi).

A relative scheme's value for a (query i, key j) pair depends only on the offset p_i - p_j, so a forward keeps
one value per grid offset, (2H - 1)(2W - 1) of them, plus one for pairs involving prefix tokens; each block
gathers the rows it needs (all of them, or one chunk of query rows) through an offset index built from
coordinate differences. A large grid never holds an (N, N) map; small grids cache the full index instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch

from ..checks import check_int, check_positive
from ..grid import is_symbolic_grid
from ..interfaces.bias import OffsetBias, offset_score_mod

_T = TypeVar("_T")

__all__ = [
    "DistanceState",
    "GlobalSlope",
    "OffsetBias",
    "OffsetState",
    "TokenSpan",
    "distance_state",
    "full_offset_index",
    "gather_offsets",
    "offset_score_mod",
    "offset_state",
    "query_rows",
    "span_length",
]


class GlobalSlope:
    """Mixin for the distance-penalty schemes (LookHere, 2D ALiBi): ``global_slope``, s_g, which multiplies every
    penalty and is tuned at test time on a built model (``scheme.global_slope = 0.95``).

    A plain float, not a buffer (checkpoints load at any s_g), checked whenever it is set: 0 would turn LookHere's
    +inf outside the view into NaN (inf * 0) and remove ALiBi's bias, a negative or NaN value would make distance
    a reward or the logits NaN. The schemes' slope buffers stay fp32 when the model is cast to half precision.
    """

    @property
    def global_slope(self) -> float:
        return self._global_slope

    def _apply(self, fn, *args, **kwargs):
        # model.to(bfloat16) casts every floating buffer: the slope buffers (head, layer) stay fp32, where the bias
        # is computed before its one rounding to the activation dtype (fp32 copies moved to the new device)
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        module = super()._apply(fn, *args, **kwargs)
        for name, buf in self._buffers.items():
            if name in kept and torch.finfo(buf.dtype).bits < 32:
                self._buffers[name] = kept[name].to(device=buf.device, dtype=torch.float32)
        return module

    @global_slope.setter
    def global_slope(self, value: float) -> None:
        self._global_slope = check_positive(value, "global_slope")


class TokenSpan(NamedTuple):
    """Contiguous tokens ``start:stop`` of a sequence whose length is symbolic (export with dynamic height and
    width): the stand-in for a ``range``, which would fix the traced length (``range`` and ``len`` take Python ints).
    ``start`` and ``stop`` are non-negative, ``stop >= start``."""

    start: int
    stop: int


def query_rows(rows: slice | None, total: int) -> range | TokenSpan:
    """The query rows a ``rows`` argument names (all ``total`` rows for None); only contiguous slices.

    A ``range``, or a :class:`TokenSpan` when ``total`` is symbolic (a ``torch.SymInt``); :func:`span_length`
    counts either."""
    if rows is not None and (not isinstance(rows, slice) or rows.step not in (None, 1)):
        raise ValueError(f"rows must be a contiguous slice of query rows, got {rows!r}")
    if isinstance(total, torch.SymInt):
        if rows is None:
            return TokenSpan(0, total)
        start, stop = 0 if rows.start is None else rows.start, total if rows.stop is None else rows.stop
        for low, high in ((0, start), (start, stop), (stop, total)):  # one check each: no Python `and` of sizes
            torch._check(low <= high, lambda: f"rows {rows} must be a slice within the {total} tokens")
        return TokenSpan(start, stop)
    return range(total) if rows is None else range(total)[rows]


def span_length(span: range | TokenSpan) -> int:
    """The number of tokens of a ``range`` or :class:`TokenSpan` (symbolic for a symbolic span).

    Example:
        >>> span_length(range(2, 5)), span_length(TokenSpan(2, 5))
        (3, 3)
    """
    return len(span) if isinstance(span, range) else span.stop - span.start


def gather_offsets(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[..., index]`` for a per-offset table (..., K + 1) and an (R, C) index: (..., R, C).

    ``torch.gather`` with the flattened index expanded (a view) over the table's leading dims. On CPU,
    ``index_select`` along the last dim gathers one element at a time inside a loop over the leading dims: for
    iRPE's (B, heads, R n_b) query-bucket products it was 3x slower forward and backward at 224 px (batch 8) and
    8x slower at 1024 px (one chunk of query rows), and advanced indexing is slower still.
    """
    flat = index.flatten().long()  # gather takes int64 indices (the offset maps are int32); a no-op on int64
    return table.gather(-1, flat.expand(*table.shape[:-1], -1)).unflatten(-1, tuple(index.shape))


@dataclass
class OffsetState:
    """Per-forward state of a relative scheme on a 2D grid, O(H W): its values live in per-offset tables.

    The offset of query token i and key token j, (y_i - y_j, x_i - x_j) on ``index`` coordinates, is entry
    (y_i - y_j + H - 1) (2W - 1) + x_i - x_j + W - 1 of a flattened (2H - 1, 2W - 1) table; entry
    K = (2H - 1)(2W - 1) holds the value of pairs that involve one of the ``num_prefix_tokens`` prefix tokens
    (which come first). ``index``: the full (P + N, P + N) index, cached for small grids only.
    """

    grid_size: tuple[int, int]
    num_prefix_tokens: int
    device: torch.device | None = None
    index: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    @property
    def num_offsets(self) -> int:
        return (2 * self.grid_size[0] - 1) * (2 * self.grid_size[1] - 1)

    def visit(self, offsets: Callable[[OffsetState], _T], coordinates: Callable[[Any], _T]) -> _T:
        """``offsets(self)``: this state's values live per grid offset. A scheme whose state may also hold drawn
        coordinates (:class:`~visionpe.bias.distance.CoordinateState`, which calls ``coordinates``) picks its
        computation through this call, whatever the state."""
        return offsets(self)

    def offset_index(self, rows: range | TokenSpan, cols: range | TokenSpan) -> torch.Tensor:
        """int32 (R, C) table index of every (query in ``rows``, key in ``cols``) pair (a symbolic grid always holds
        the full index, see :func:`offset_state`)."""
        if self.index is not None:
            return self.index[rows.start : rows.stop, cols.start : cols.stop]
        (height, width), p = self.grid_size, self.num_prefix_tokens
        r = torch.arange(max(rows.start, p) - p, max(rows.stop, p) - p, device=self.device, dtype=torch.int32)
        c = torch.arange(max(cols.start, p) - p, max(cols.stop, p) - p, device=self.device, dtype=torch.int32)
        # built in place from coordinate differences: the (R, C) block is the only large tensor
        patch = (r // width)[:, None] - (c // width)[None, :]
        patch.add_(height - 1).mul_(2 * width - 1).add_((r % width)[:, None] - (c % width)[None, :]).add_(width - 1)
        top, left = max(0, min(rows.stop, p) - rows.start), max(0, min(cols.stop, p) - cols.start)
        if not (top or left):
            return patch
        out = patch.new_full((len(rows), len(cols)), self.num_offsets)
        out[top:, left:] = patch
        return out

    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (2H - 1, 2W - 1) grids of the table's offsets y_i - y_j and x_i - x_j."""
        height, width = self.grid_size
        dy = torch.arange(1 - height, height, device=self.device, dtype=torch.float32)
        dx = torch.arange(1 - width, width, device=self.device, dtype=torch.float32)
        return dy[:, None].expand(-1, 2 * width - 1), dx[None, :].expand(2 * height - 1, -1)


def offset_state(grid_size: tuple[int, int], num_prefix_tokens: int, device, full_state_max_tokens: int) -> OffsetState:
    """:class:`OffsetState` for a 2D grid; the full index is cached when P + N <= ``full_state_max_tokens``.

    A symbolic grid (export with dynamic height and width) always holds the full index, built in the graph from the
    symbolic sizes (:func:`full_offset_index`): comparing its token count with ``full_state_max_tokens`` would fix
    the traced grid, and the exported graph runs its blocks on every query row at once."""
    check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
    state = OffsetState(tuple(grid_size), num_prefix_tokens, torch.device(device) if device is not None else None)
    if is_symbolic_grid(state.grid_size):
        state.index = full_offset_index(state.grid_size, num_prefix_tokens, state.device)
    elif state.num_tokens <= full_state_max_tokens:
        every = range(state.num_tokens)
        state.index = state.offset_index(every, every)
    return state


def full_offset_index(grid_size: tuple[int, int], num_prefix_tokens: int, device=None) -> torch.Tensor:
    """int32 (P + N, P + N) offset index of every token pair of a 2D grid (:meth:`OffsetState.offset_index` of all
    rows and columns), computed with tensor ops only, so that a symbolic grid stays symbolic in an exported graph.

    Example:
        >>> full_offset_index((1, 2), 1)  # K = 3 offsets (0, -1), (0, 0), (0, 1); entry 3 for the prefix pairs
        tensor([[3, 3, 3],
                [3, 1, 0],
                [3, 2, 1]], dtype=torch.int32)
    """
    height, width = grid_size
    # prefix tokens first, at negative token numbers; their pairs read entry K (a masked fill: a padding value or a
    # Python comparison would fix a symbolic K)
    token = torch.arange(-num_prefix_tokens, height * width, device=device, dtype=torch.int32)
    patch = token.clamp_min(0)
    y, x = patch // width, patch % width
    index = (y[:, None] - y[None, :] + (height - 1)) * (2 * width - 1) + (x[:, None] - x[None, :] + (width - 1))
    prefix = token < 0
    return index.masked_fill(prefix[:, None] | prefix[None, :], (2 * height - 1) * (2 * width - 1))


@dataclass
class DistanceState(OffsetState):
    """:class:`OffsetState` with ``table``: fp32 (K + 1,) distances ||p_i - p_j|| per offset, 0 for prefix pairs."""

    table: torch.Tensor | None = None

    def distances(self, rows: slice | None = None) -> torch.Tensor:
        """||p_i - p_j||, fp32 (R, P + N) for the query ``rows`` (all rows for None)."""
        every = query_rows(None, self.num_tokens)
        return gather_offsets(self.table, self.offset_index(query_rows(rows, self.num_tokens), every))


def distance_state(
    grid_size: tuple[int, int], num_prefix_tokens: int, device, full_state_max_tokens: int
) -> DistanceState:
    """:class:`DistanceState` for a 2D grid (full index cached for small grids, see :func:`offset_state`)."""
    base = offset_state(grid_size, num_prefix_tokens, device, full_state_max_tokens)
    dy, dx = base.offsets()
    # sqrt of the exact integer sum of squares: the same values as cdist's direct (non-matmul) mode
    table = torch.cat((dy.square().add_(dx.square()).sqrt_().flatten(), dy.new_zeros(1)))
    return DistanceState(base.grid_size, base.num_prefix_tokens, base.device, base.index, table)
