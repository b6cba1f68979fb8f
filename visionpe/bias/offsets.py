"""Per-offset state shared by the relative bias schemes (iRPE, LookHere, 2D ALiBi).

A relative scheme's value for a (query i, key j) pair depends only on the offset p_i - p_j, so a forward keeps
one value per grid offset, (2H - 1)(2W - 1) of them, plus one for pairs involving prefix tokens; each block
gathers the rows it needs (all of them, or one chunk of query rows) through an offset index built from
coordinate differences. A large grid never holds an (N, N) map; small grids cache the full index instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int, check_positive

__all__ = [
    "DistanceState",
    "GlobalSlope",
    "OffsetState",
    "distance_state",
    "gather_offsets",
    "offset_state",
    "query_rows",
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


def query_rows(rows: slice | None, total: int) -> range:
    """The query rows a ``rows`` argument names (all ``total`` rows for None); only contiguous slices."""
    if rows is None:
        return range(total)
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        raise ValueError(f"rows must be a contiguous slice of query rows, got {rows!r}")
    return range(total)[rows]


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

    def offset_index(self, rows: range, cols: range) -> torch.Tensor:
        """int32 (R, C) table index of every (query in ``rows``, key in ``cols``) pair."""
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
    """:class:`OffsetState` for a 2D grid; the full index is cached when P + N <= ``full_state_max_tokens``."""
    check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
    state = OffsetState(tuple(grid_size), num_prefix_tokens, torch.device(device) if device is not None else None)
    if state.num_tokens <= full_state_max_tokens:
        every = range(state.num_tokens)
        state.index = state.offset_index(every, every)
    return state


@dataclass
class DistanceState(OffsetState):
    """:class:`OffsetState` with ``table``: fp32 (K + 1,) distances ||p_i - p_j|| per offset, 0 for prefix pairs."""

    table: torch.Tensor | None = None

    def distances(self, rows: slice | None = None) -> torch.Tensor:
        """||p_i - p_j||, fp32 (R, P + N) for the query ``rows`` (all rows for None)."""
        every = range(self.num_tokens)
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
