"""iRPE: Wu et al., "Rethinking and Improving Relative Position Encoding for Vision Transformer", ICCV 2021.

e_ij = (q_i k_j + b_ij) / sqrt(d), with b_ij = r_{I(i,j)} (bias mode) or q_i r^K_{I(i,j)} (contextual, on K;
+ k_j r^Q_{I(i,j)} on Q); on V: z_i = sum_j a_ij (v_j + r^V_{I(i,j)}). The bucket I(i,j) comes from the
piecewise index g(x) = round(x) if |x| <= alpha, else sign(x) min(beta, round(alpha + ln(|x|/alpha) /
ln(gamma/alpha) (beta - alpha))), alpha:beta:gamma = r:2r:8r, applied to the (row, col) offset by one of four
methods (euclidean, quant, cross, product). Pairs involving a prefix token read one extra bucket, once (cross
included, whose two per-axis lookups both land on it: each reads half of its entry).
As in the reference code, q is scaled by 1/sqrt(d) before the contextual products, and the bias-mode scalar
r_{I(i,j)} is added to the logits as it is (not divided by sqrt(d)); the bias-mode q term reads bucket I(j, i)
(the reference's key-side lookup, transposed), so its tables load unchanged.

Computed bucket-first, without the authors' CUDA op: Z = q R^K is (B, h, N, n_buckets), then b_ij =
Z[i, I(i,j)] is a gather by the bucket map. The value term scatter-adds the attention probabilities into bucket
sums (B, h, N, n_buckets) and multiplies by the value table. Bucket sums of half-precision probabilities, and the
contextual products Z of half-precision (or autocast) q and k with the gather that reads them, are computed in fp32:
a saturated bucket collects thousands of terms, which a bf16 accumulator (CUDA's scatter_add, and the gather's
backward) would round after every add; the bias and the value term are rounded to the activation dtype once.

Memory: the per-grid state is the bucket of every offset, (2H - 1)(2W - 1) values; each block gathers the rows
of the bucket map it needs (all rows, or one chunk of query rows when attention runs in query chunks) through an
offset index built from coordinate differences, so a large grid never holds an (N, N) map. Small grids
(``full_state_max_tokens``) cache the full gather map instead, which is cheaper than rebuilding it in every block.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..base import BiasPositionEncoding, check_model_shape
from ..checks import check_bool, check_choice, check_instance, check_int, check_positive, check_tensor
from ..grid import is_symbolic_grid, validate_grid_size
from ..registry import register_scheme
from .offsets import OffsetBias, OffsetState, gather_offsets, offset_state, query_rows, span_length

__all__ = [
    "IRPE",
    "IRPEState",
    "IRPE_METHODS",
    "IRPE_MODES",
    "irpe_piecewise_index",
    "irpe_num_buckets",
    "irpe_bucket_ids",
]

IRPE_METHODS = ("euclidean", "quant", "cross", "product")
IRPE_MODES = ("bias", "contextual")
_MAX_CACHED_GRIDS = 8


def irpe_piecewise_index(rel: torch.Tensor, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """The piecewise index g of iRPE: exact near zero, logarithmic beyond ``alpha``, saturating at ``beta``.

    g(x) = round(x) if |x| <= alpha, else sign(x) * trunc(min(beta, round(alpha + ln(|x|/alpha) /
    ln(gamma/alpha) * (beta - alpha)))). Rounding is half-to-even, as ``torch.round`` in the reference code.

    Args:
        rel: relative positions, any shape, real or integer.
        alpha, beta, gamma: 0 < alpha <= beta, round(alpha) <= floor(beta), gamma > alpha (the paper uses
            r : 2r : 8r, which always satisfies them).

    Returns:
        int64 tensor of the shape of ``rel``, values in [-floor(beta), floor(beta)].

    Example:
        >>> irpe_piecewise_index(torch.arange(6), 1.9, 3.8, 15.2)
        tensor([0, 1, 2, 2, 3, 3])
    """
    check_tensor(rel, "rel")
    alpha, beta, gamma = (check_positive(v, n) for n, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)))
    if beta < alpha:
        raise ValueError(f"beta must be >= alpha, got alpha={alpha}, beta={beta}")
    if round(alpha) > math.floor(beta):  # round(x) for |x| <= alpha would leave [-floor(beta), floor(beta)]
        raise ValueError(
            f"alpha and beta must satisfy round(alpha) <= floor(beta) (outputs in [-floor(beta), floor(beta)]), "
            f"got alpha={alpha}, beta={beta}: round(alpha)={round(alpha)} > floor(beta)={math.floor(beta)}"
        )
    if gamma <= alpha:
        raise ValueError(f"gamma must be > alpha, got alpha={alpha}, gamma={gamma}")
    check_tensor(rel, "rel", dtype="real")
    rel = rel.to(torch.float64)
    if not torch.compiler.is_compiling() and not torch.isfinite(rel).all():  # no data-dependent branch in graphs
        raise ValueError("rel must be finite, got NaN or inf relative positions")
    rel_abs = rel.abs()
    far = alpha + torch.log(rel_abs.clamp_min(alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    far = torch.sign(rel) * far.round().clamp_max(beta)
    return torch.where(rel_abs <= alpha, rel.round(), far).trunc().long()


def irpe_num_buckets(method: str, ratio: float = 1.9, num_prefix_tokens: int = 0) -> int:
    """Number of buckets for ``method`` with alpha:beta:gamma = r:2r:8r, plus one when there are prefix tokens.

    With S = 2 floor(2r) + 1: euclidean and quant S, cross 2S, product S^2.

    Example:
        >>> irpe_num_buckets("product", 1.9), irpe_num_buckets("product", 1.9, num_prefix_tokens=1)
        (49, 50)
    """
    _check_method(method)
    ratio = check_positive(ratio, "ratio")
    check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
    side = 2 * math.floor(2 * ratio) + 1
    count = {"euclidean": side, "quant": side, "cross": 2 * side, "product": side * side}[method]
    return count + (1 if num_prefix_tokens > 0 else 0)


def irpe_bucket_ids(
    grid_size: Sequence[int],
    method: str = "product",
    ratio: float = 1.9,
    num_prefix_tokens: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bucket map I(i, j) for all token pairs of an (H, W) grid, prefix tokens first.

    The offset is pos_i - pos_j in (row, col) order on ``index`` coordinates; the prefix rows and columns hold
    the extra bucket ``irpe_num_buckets(method, ratio)``.

    Returns:
        int64 ``(P + N, P + N)`` for euclidean, quant and product; ``(2, P + N, P + N)`` for cross, the
        row-offset buckets in [0, S) and the column-offset buckets in [S, 2S). A cross prefix pair holds the extra
        bucket in both halves and reads it once: :class:`IRPE` sums the two halves with half the extra entry each.

    Example:
        >>> irpe_bucket_ids((1, 2), "product", 1.9)
        tensor([[24, 23],
                [25, 24]])
    """
    grid_size = validate_grid_size(grid_size, ndims=(2,))
    _check_method(method)
    ratio = check_positive(ratio, "ratio")
    check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
    state = offset_state(grid_size, num_prefix_tokens, device, 0)
    table = _bucket_table(state, method, ratio)
    every = range(state.num_tokens)
    return gather_offsets(table, state.offset_index(every, every)).long()


def _bucket_table(state: OffsetState, method: str, ratio: float) -> torch.Tensor:
    """Bucket of every grid offset, int32 (K + 1,) ((2, K + 1) for cross); entry K: the extra prefix bucket."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    max_id = math.floor(beta)
    side = 2 * max_id + 1
    dy, dx = (t.long() for t in state.offsets())  # (2H - 1, 2W - 1): y_i - y_j, x_i - x_j
    if method == "euclidean":
        table = irpe_piecewise_index((dy.square() + dx.square()).double().sqrt().round(), alpha, beta, gamma) + max_id
    elif method == "quant":
        # the reference code buckets the squared distance (the paper describes its rank)
        table = irpe_piecewise_index(dy.square() + dx.square(), alpha, beta, gamma) + max_id
    else:
        by = irpe_piecewise_index(dy, alpha, beta, gamma) + max_id
        bx = irpe_piecewise_index(dx, alpha, beta, gamma) + max_id
        table = torch.stack((by, bx + side)) if method == "cross" else by * side + bx
    table = table.flatten(-2)
    extra = table.new_full((*table.shape[:-1], 1), irpe_num_buckets(method, ratio))
    return torch.cat((table, extra), dim=-1).int()


def _check_method(method: str) -> None:
    check_choice(method, "iRPE method", IRPE_METHODS)


@dataclass
class IRPEState(OffsetState):
    """Per-forward iRPE state for one grid (see :class:`~visionpe.bias.offsets.OffsetState`), O(H W) for
    large grids.

    ``table``: int32 (K + 1,) ((2, K + 1) for cross), the bucket of each grid offset, entry K the extra bucket
    of prefix pairs. ``flat``, cached for small grids only: ``flat[..., i, j] = i * n_buckets + I(i, j)``,
    (P + N, P + N) ((2, P + N, P + N) for cross), the index of Z[..., i, I(i, j)] in Z.flatten(-2) for Z of
    shape (..., P + N, n_buckets).
    """

    table: torch.Tensor | None = None
    flat: torch.Tensor | None = None


@register_scheme("irpe")
class IRPE(BiasPositionEncoding):
    """Image relative position encoding (iRPE), one set of tables per block.

    Args:
        dim, num_heads, depth: model shape; tables are per block, shared across heads if ``shared_heads``.
        method: ``euclidean``, ``quant``, ``cross`` or ``product`` (default, the paper's best).
        mode: ``contextual`` (default) or ``bias`` (scalar per bucket, q and k only).
        on: any of ``"q"``, ``"k"``, ``"v"`` (default ``"k"``, the DeiT setting); ``"v"`` needs contextual mode.
        ratio: r in alpha:beta:gamma = r:2r:8r (default 1.9, 49 product buckets).
        shared_heads: one table for all heads (default, as in the paper's DeiT models).
        num_prefix_tokens: prefix tokens the model has; with any, one extra bucket is added.

    Table shapes (zero init, no weight decay): bias (depth, h', n_b); contextual q/k (depth, h', head_dim, n_b);
    v (depth, h', n_b, head_dim), h' = 1 with shared heads.
    """

    ndims = (2,)
    attention_backends = ("sdpa", "flex")  # per-offset terms for FlexAttention (fused_bias)
    # torch.onnx's decomposition of an attention with a bias computed from parameters fails on a view (torch 2.14)
    onnx_refusal = "torch.onnx fails to decompose the attention with a bias computed from parameters"
    # grids up to this many tokens cache their full (P + N)^2 int32 gather map (4 MB at 1024 tokens); larger
    # grids gather the rows each block needs from the offset table
    full_state_max_tokens: int = 1024

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        method: str = "product",
        mode: str = "contextual",
        on: str | Sequence[str] = "k",
        ratio: float = 1.9,
        shared_heads: bool = True,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__()
        _check_method(method)
        check_choice(mode, "iRPE mode", IRPE_MODES)
        targets = "a str or a sequence of targets among 'q', 'k', 'v' (e.g. 'k' or 'qkv')"
        check_instance(on, "on", (str, Sequence), expected=targets)
        check_bool(shared_heads, "shared_heads")
        on_set = tuple(on)
        if not on_set or any(t not in ("q", "k", "v") for t in on_set) or len(set(on_set)) != len(on_set):
            raise ValueError(f"on must name distinct targets among 'q', 'k', 'v' (e.g. 'k' or 'qkv'), got {on!r}")
        if mode == "bias" and "v" in on_set:
            raise ValueError("iRPE on 'v' exists only in mode='contextual'; bias mode is defined for 'q' and 'k'")
        check_model_shape(dim, num_heads, depth)
        check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
        self.method, self.mode, self.on = method, mode, "".join(t for t in "qkv" if t in on_set)
        self.ratio, self.shared_heads = check_positive(ratio, "ratio"), shared_heads
        self.num_prefix_tokens, self.num_heads, self.head_dim = num_prefix_tokens, num_heads, dim // num_heads
        self.num_buckets = irpe_num_buckets(method, self.ratio, num_prefix_tokens)
        self.needs_probs = "v" in self.on
        self.batch_shared_bias = mode == "bias"  # a scalar per bucket: no q or k in the logit terms
        heads = 1 if self.shared_heads else num_heads
        shapes = {
            "q": (depth, heads, self.head_dim, self.num_buckets),
            "k": (depth, heads, self.head_dim, self.num_buckets),
            "v": (depth, heads, self.num_buckets, self.head_dim),
        }
        self.tables = nn.ParameterDict(
            {
                t: nn.Parameter(torch.zeros(shapes[t] if mode == "contextual" else (depth, heads, self.num_buckets)))
                for t in self.on
            }
        )
        self._cache: dict[tuple, IRPEState] = {}

    def prepare(self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None) -> IRPEState:
        """Offset buckets for ``grid_size`` (and the full map for small grids), cached per (grid, prefix, device).

        A symbolic grid (export with dynamic height and width) builds the full map in the graph, uncached."""
        grid_size = self.check_grid(grid_size)
        check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
        if (num_prefix_tokens > 0) != (self.num_prefix_tokens > 0):
            raise ValueError(
                f"iRPE tables were built for num_prefix_tokens={self.num_prefix_tokens} "
                f"({self.num_buckets} buckets), got num_prefix_tokens={num_prefix_tokens}"
            )
        symbolic = is_symbolic_grid(grid_size)
        full = symbolic or num_prefix_tokens + math.prod(grid_size) <= self.full_state_max_tokens
        key = (grid_size, num_prefix_tokens, str(torch.device(device) if device is not None else "cpu"), full)
        state = None if symbolic else self._cache.get(key)
        if state is None:
            base = offset_state(grid_size, num_prefix_tokens, device, 0)
            state = IRPEState(base.grid_size, base.num_prefix_tokens, base.device, base.index)
            state.table = _bucket_table(state, self.method, self.ratio)
            if full:
                every = query_rows(None, state.num_tokens)
                state.flat = self._flat_ids(state, every, every)
            if symbolic:
                return state
            if len(self._cache) >= _MAX_CACHED_GRIDS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = state
        return state

    def _lookup(self, values: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """values (..., M, n_b), flat (M, K) -> (..., M, K): values.flatten(-2)[..., flat] (summed for cross)."""
        flat_values = values.flatten(-2)
        if self.method == "cross":
            return gather_offsets(flat_values, flat[0]) + gather_offsets(flat_values, flat[1])
        return gather_offsets(flat_values, flat)

    def _table(self, target: str, layer: int) -> torch.Tensor:
        """The ``target`` table of block ``layer`` as the lookups read it.

        Cross sums a row-offset and a column-offset lookup, and a prefix pair finds the one extra bucket in both:
        each half reads half of its entry, so the pair gets the entry exactly once (x/2 + x/2 = x in floating
        point), and so does its gradient. The other methods, and cross without prefix tokens, read the table as is.
        """
        table = self.tables[target][layer]
        if self.method != "cross" or self.num_prefix_tokens == 0:
            return table
        bucket_dim = -2 if target == "v" and self.mode == "contextual" else -1  # v: (h', n_b, d); q, k: (.., n_b)
        head, extra = table.split((self.num_buckets - 1, 1), dim=bucket_dim)
        return torch.cat((head, extra * 0.5), dim=bucket_dim)

    def _flat_ids(self, state: IRPEState, rows: range, cols: range) -> torch.Tensor:
        """Gather indices (..., R, C) for query tokens ``rows`` and key tokens ``cols``: the rows of ``state.flat``,
        re-based so that token ``rows.start`` is row 0 of Z."""
        if state.flat is not None:
            return state.flat[..., rows.start : rows.stop, cols.start : cols.stop] - rows.start * self.num_buckets
        ids = gather_offsets(state.table, state.offset_index(rows, cols))
        rows_here = torch.arange(span_length(rows), device=ids.device, dtype=ids.dtype)
        return ids.add_(rows_here[:, None] * self.num_buckets)

    def _check_layer(self, layer: int) -> None:
        depth = next(iter(self.tables.values())).shape[0]
        check_int(layer, "layer", min=0, max=depth - 1, expected=f"an int in [0, depth={depth})")

    def _check_rows(self, x: torch.Tensor, state: IRPEState, name: str, rows: slice | None) -> int:
        expected = span_length(query_rows(rows, state.num_tokens))
        shape = (self.num_heads, expected, self.head_dim)
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or tuple(x.shape[1:]) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name} must have shape (B, num_heads={self.num_heads}, {expected}, {self.head_dim}) for this grid"
                f"{'' if rows is None else f' and rows={rows}'}, got {got}"
            )
        check_tensor(x, name, dtype="floating")
        return expected

    def attn_bias(
        self, q: torch.Tensor, k: torch.Tensor, state: IRPEState, layer: int, rows: slice | None = None
    ) -> torch.Tensor:
        """Logits (B or 1, h or 1, R, P + N) in the dtype of q, from q (B, h, R, head_dim) and k
        (B, h, P + N, head_dim).

        R = P + N, or the query rows ``rows`` (a slice) when attention is computed in query chunks. For fp16/bf16
        q and k, or under autocast, the products Z = q R^K, k R^Q and their gathers (whose backward adds up each
        bucket's gradient) run in fp32 without autocast; the bias is rounded to q's dtype once.
        """
        num_rows = self._check_rows(q, state, "q", rows)
        self._check_rows(k, state, "k", None)
        self._check_layer(layer)
        selected, every = query_rows(rows, state.num_tokens), query_rows(None, state.num_tokens)
        flat = self._flat_ids(state, selected, every)
        bias = None
        scale = self.head_dim**-0.5  # (q / sqrt(d)) R = q (R / sqrt(d)): scale the small table, not q
        low = torch.finfo(q.dtype).bits < 32 or torch.finfo(k.dtype).bits < 32
        exact = low or torch.is_autocast_enabled(q.device.type)
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32) if exact else q.dtype
        with torch.autocast(q.device.type, enabled=False) if exact else contextlib.nullcontext():
            for target in self.on.replace("v", ""):
                table = self._table(target, layer)
                if target == "k":
                    if self.mode == "bias":
                        values = table[None, :, None, :].expand(-1, -1, num_rows, -1)
                        term = self._lookup(values.float() if low else values, flat)
                    else:
                        term = self._lookup(q.to(dtype) @ (table * scale).to(dtype), flat)
                else:
                    # the query-side term is a key-side lookup, transposed, as the reference code does in both
                    # modes: pair (i, j) reads bucket I(j, i) of the q table (for product and cross, of -delta)
                    flat_t = self._flat_ids(state, every, selected)
                    if self.mode == "bias":
                        values = table[None, :, None, :].expand(-1, -1, state.num_tokens, -1)
                        values = values.float() if low else values
                    else:
                        values = k.to(dtype) @ (table * scale).to(dtype)
                    term = self._lookup(values, flat_t).transpose(-2, -1)
                bias = term if bias is None else bias + term
        if bias is None:  # values only: no logit term
            return q.new_zeros(1, 1, 1, 1)
        return bias.to(q.dtype) if exact else bias

    def fused_bias(self, q: torch.Tensor, k: torch.Tensor, state: IRPEState, layer: int) -> list[OffsetBias]:
        """The logit terms per grid offset for fused attention, with the values :meth:`attn_bias` adds.

        Each term reads a bucket's value through ``state.table`` (the bucket of every grid offset; cross: one term per
        half): the table itself in bias mode, the products q R^K (B, h, P + N, n_b) of every query in contextual mode;
        the query-side term reads key j's row at the bucket of p_j - p_i. Computed in fp32 for half-precision q and k.
        """
        self._check_rows(q, state, "q", None)
        self._check_rows(k, state, "k", None)
        self._check_layer(layer)
        scale = self.head_dim**-0.5
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
        columns = state.table.long().unbind(0) if self.method == "cross" else (state.table.long(),)
        terms = []
        with torch.autocast(q.device.type, enabled=False):
            for target in self.on.replace("v", ""):
                table = self._table(target, layer)
                if self.mode == "bias":
                    values = table.to(dtype)[None, :, None, :]
                else:
                    values = (q if target == "k" else k).to(dtype) @ (table * scale).to(dtype)
                terms += [OffsetBias(state, values, column, by_key=target == "q") for column in columns]
        return terms

    def value_term(self, attn: torch.Tensor, state: IRPEState, layer: int, rows: slice | None = None) -> torch.Tensor:
        """sum_j a_ij r^V_{I(i,j)}: probabilities ``attn`` (B, h, R, P + N) -> (B, h, R, head_dim).

        R = P + N, or the query rows ``rows`` when attention is computed in query chunks. fp16/bf16 probabilities
        are summed into their buckets in fp32 (without autocast); the result is rounded to attn's dtype once.
        """
        if "v" not in self.on:
            return super().value_term(attn, state, layer)
        self._check_layer(layer)
        n = state.num_tokens
        selected = query_rows(rows, n)
        num_rows = span_length(selected)
        expected = (self.num_heads, num_rows, n)
        if not isinstance(attn, torch.Tensor) or attn.ndim != 4 or tuple(attn.shape[1:]) != expected:
            shape = tuple(attn.shape) if isinstance(attn, torch.Tensor) else type(attn).__name__
            raise ValueError(f"attn must have shape (B, num_heads={self.num_heads}, {num_rows}, {n}), got {shape}")
        check_tensor(attn, "attn", dtype="floating")
        flat = self._flat_ids(state, selected, query_rows(None, n))
        table = self._table("v", layer)
        # a saturated bucket sums thousands of probabilities: in fp32 for half-precision attn (CUDA's scatter_add
        # rounds to the slot's dtype after every add), as they are for fp32 and fp64
        low = torch.finfo(attn.dtype).bits < 32
        with torch.autocast(attn.device.type, enabled=False) if low else contextlib.nullcontext():
            flat_attn = attn.flatten(-2).float() if low else attn.flatten(-2)
            sums = flat_attn.new_zeros(*attn.shape[:2], num_rows * self.num_buckets)
            for flat_ids in flat if self.method == "cross" else (flat,):
                # scatter_add with the index expanded over (B, heads), not index_add along the last dim, which adds
                # one element at a time inside a loop over (B, heads): 2.6x (224 px) to 10x (1024 px) faster on CPU
                sums = sums.scatter_add(-1, flat_ids.flatten().long().expand_as(flat_attn), flat_attn)
            out = sums.unflatten(-1, (num_rows, self.num_buckets)) @ table.to(sums.dtype)
        return out.to(attn.dtype) if low else out

    def no_weight_decay(self) -> set[str]:
        return {f"tables.{t}" for t in self.tables}
