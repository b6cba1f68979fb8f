"""ComRoPE-LD: Yu et al., "ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable
Commuting Angle Matrices", CVPR 2025 (Longin-Yu/ComRoPE).

Linearly dependent generators: B_ij = theta_ij (P_j - P_j^T), so sum_i x_i A_i has block j equal to
(sum_i theta_ij x_i)(P_j - P_j^T): all A_i commute and R(x)^T R(y) = R(y - x) exactly.
P: (h, m, b, b) ~ N(0, init_std^2) per layer; theta: (n_axes, m) ~ N(0, 1) per layer, shared across heads.
Positions and prefix handling as ComRoPE-AP (:mod:`.comrope_ap`).

Cost: the terms of the exponent commute, so exp(sum_i theta_ij x_i S_j) = prod_i exp(theta_ij x_i S_j): one
exponential per distinct value of each coordinate (all axes in one series call), then one b x b product per block
and extra axis (:class:`DependentTables`) instead of one exponential per token; gradients flow exactly.
When the tokens are a whole grid in row-major order (a Cartesian product of the per-axis values, as patch tokens
are), the products of a block for all tokens are one (b n_0) x b @ b x (b n_1) matrix product per head and block
(:func:`grid_product`), also after prefix tokens rotated at one position (the default ``rotate_prefix=True``:
their rotation is built once and placed before the grid's, :func:`prefix_grid_rows`); other coordinates
(jittered positions) gather each token's factors. Without autograd the gather and product run by token chunks.
Under ``torch.compile`` and ``torch.export`` (where the count of distinct values is a data-dependent shape) each
axis' factor is taken at every token's own coordinate instead, then multiplied in the same order
(:class:`TokenTables`): the same factors per axis and their product, one exponential per token and axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..registry import register_scheme
from .block_rotation import TokenRotations
from .comrope_base import ComRoPEBase, distinct_values
from .expm import LayerExponentials

__all__ = ["ComRoPELD"]


@register_scheme("comrope_ld")
class ComRoPELD(ComRoPEBase):
    """ComRoPE with linearly dependent generators.

    Args:
        dim, num_heads, depth: model shape.
        block_size: b, 8 by default.
        ndim: 2 (y, x) or 3 (t, y, x).
        init_std: P ~ N(0, init_std^2); theta ~ N(0, 1).
        pos_norm, rotate_prefix, grid_size, extrapolation, jitter_std, offset_std, rotate_values, time_norm: as
            :class:`~visionpe.rotary.comrope_ap.ComRoPEAP` (prefix tokens rotated at the grid centre by default;
            NTK / YaRN rescale the eigenfrequencies of theta_aj S_j per axis; the augmentations apply in training
            only and are off by default).
    """

    def init_generators(self) -> None:
        self.multipliers = nn.Parameter(torch.randn(self.depth, self.num_blocks, self.ndim))

    def generators(self, layer: int) -> torch.Tensor:
        theta = self.multipliers[layer if self.multipliers.shape[0] > 1 else 0]  # (m, ndim)
        return self.skew_blocks(layer).unsqueeze(2) * theta[None, :, :, None, None]

    def axis_coefficients(self) -> torch.Tensor:
        return self.multipliers.transpose(1, 2)

    def rotation_plan(
        self, coords: torch.Tensor, factors: Sequence[float] | None = None
    ) -> Callable[[int], TokenRotations]:
        # (L, 1, h, m, b, b) skew blocks, or (L, ndim, h, m, b, b) per axis (NTK / YaRN)
        skew = self.layer_skew_blocks().unsqueeze(1) if factors is None else self.axis_skew_blocks(factors)
        theta = self.multipliers.transpose(1, 2)[:, :, None, :, None, None]  # (L, ndim, 1, m, 1, 1)
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():
            # a traced graph (the count of distinct values would be a data-dependent shape): per axis a, the
            # factors exp(x_a theta_aj S_j) at every token's own coordinate, multiplied as in eager mode
            gen = (skew * theta).unsqueeze(4)  # (L, ndim, h, m, 1, b, b)
            with torch.no_grad():  # eager mode's squaring count: every axis' generators at every coordinate value
                gram = gen.detach().to(self.series_dtype).square().sum((-2, -1)).flatten(1).amax(1, keepdim=True)
                largest = coords.detach().to(self.series_dtype).square().max() if coords.numel() else 0.0
                norm2 = gram * largest  # (L, 1)
            axes = [
                LayerExponentials(gen[:, a], coords[:, a, None], self.series_dtype, norm2) for a in range(self.ndim)
            ]
            return TokenTables(axes).layer
        # exp(v theta_aj S_j) for every axis a and distinct coordinate value v (of any axis), in one series per
        # layer (word tables of all layers at once): the axes stack on the head dimension, (L, ndim h, m, 1, b, b)
        # generators theta_aj S_j
        values, inverse = distinct_values(coords)  # inverse: (N, ndim)
        gen = (skew * theta).flatten(1, 2).unsqueeze(3)
        return DependentTables(LayerExponentials(gen, values[:, None], self.series_dtype), inverse, self.ndim).layer


class DependentTables:
    """ComRoPE-LD's exponentials for one forward: exp(v theta_aj S_j) for every axis a and distinct coordinate value
    v, and ``inverse`` (N, ndim), each token's value per axis."""

    def __init__(self, exponentials: LayerExponentials, inverse: torch.Tensor, ndim: int) -> None:
        self.exponentials, self.ndim, self.inverses = exponentials, ndim, inverse.unbind(1)
        # per-axis table rows when the tokens after the first `lead` (a rotated prefix, all at one position) are a
        # whole row-major grid, else None
        self.lead, self.grid = prefix_grid_rows(inverse)

    def layer(self, layer: int) -> DependentRotations:
        exps = self.exponentials
        table = exps.layer(layer)(0, exps.num_tokens).unflatten(0, (self.ndim, -1))  # (ndim, h, V, m, b, b)
        return DependentRotations(table.unbind(0), self.inverses, self.lead, self.grid)


class TokenTables:
    """ComRoPE-LD's exponentials for one forward in a traced graph: per axis a, exp(x_a theta_aj S_j) at every
    token's own coordinate x_a (no distinct values), with eager mode's squaring count (that of every axis'
    generators at every coordinate value): the series' error, 2.3e-8 times 2^s, is then eager's. Taking exp of
    the summed exponent in one series, or each axis with its own count, would differ from eager by that error
    (2e-5 to 3e-5 in a test output with P and theta six times their initial size)."""

    def __init__(self, axes: Sequence[LayerExponentials]) -> None:
        self.axes = list(axes)

    def layer(self, layer: int) -> DependentRotations:
        tables = [exps.layer(layer)(0, exps.num_tokens) for exps in self.axes]  # (h, N, m, b, b) per axis
        rows = torch.arange(self.axes[0].num_tokens, device=tables[0].device)
        return DependentRotations(tables, [rows] * len(tables), 0, None)


class DependentRotations(TokenRotations):
    """Each token's blocks as the product over axes of its per-axis factors ``tables[a][:, inverses[a]]``: one
    grid product for a whole row-major grid (after a rotated prefix), a gathered product otherwise."""

    def __init__(
        self,
        tables: Sequence[torch.Tensor],
        inverses: Sequence[torch.Tensor],
        lead: int,
        grid: list[torch.Tensor] | None,
    ) -> None:
        self.tables, self.inverses, self.lead, self.grid = tables, inverses, lead, grid
        self.num_tokens = len(inverses[0])

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        tables, inverses, lead, grid = self.tables, self.inverses, self.lead, self.grid
        rows = tuple(inverse[start:stop] for inverse in inverses)
        with torch.autocast(tables[0].device.type, enabled=False):  # the product of the factors stays fp32
            if grid is not None and (start, stop) == (0, self.num_tokens):
                factors = [t.index_select(1, r) for t, r in zip(tables, grid, strict=True)]
                if not lead:
                    return grid_product(factors)
                # the prefix tokens share one position: one rotation per head and block, repeated
                first = _gathered_product(tuple(inverse[:1] for inverse in inverses), tables)
                return grid_product(factors, first.expand(-1, lead, -1, -1, -1))
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():
                return _GatheredProduct.apply(rows, *tables)
            return _gathered_product(rows, tables)


def grid_rows(inverse: torch.Tensor) -> list[torch.Tensor] | None:
    """The table rows of each axis when the tokens are their Cartesian product in row-major order, else None.

    Args:
        inverse: (N, ndim) index of every token's coordinate in the table of distinct values.

    Returns:
        ``rows`` with ``torch.cartesian_prod(*rows) == inverse``: the sorted distinct indices of each axis; None
        when the tokens are not every combination once in that order (jittered coordinates, a rotated prefix),
        and under torch.compile or export (a data-dependent test).
    """
    if inverse.ndim != 2 or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return None
    rows = [torch.unique(column) for column in inverse.unbind(1)]
    if math.prod(len(r) for r in rows) != len(inverse):
        return None
    full = torch.cartesian_prod(*rows) if len(rows) > 1 else rows[0][:, None]
    return rows if torch.equal(full, inverse) else None


def prefix_grid_rows(inverse: torch.Tensor) -> tuple[int, list[torch.Tensor] | None]:
    """``(lead, rows)``: ``rows = grid_rows(inverse[lead:])`` is not None, with ``inverse[:lead]`` all the same
    position (ComRoPE's rotated prefix tokens, at the grid centre, before the patch tokens); ``(0, None)`` when no
    such split exists (jittered coordinates) or under torch.compile or export.

    Any split found gives the same rotations as the gather: the first ``lead`` rows get the rotation of their one
    position, the rest the grid product.
    """
    if inverse.ndim != 2 or not len(inverse) or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return 0, None
    same = (inverse == inverse[:1]).all(1)
    lead = int(same.int().cumprod(0).sum())  # leading rows at the first token's position
    # a prefix of P tokens gives lead = P, or P + 1 when the first patch sits at the prefix position (a 1 x 1 grid);
    # no prefix gives lead = 1 (or more for a grid with repeated tokens, which is no grid)
    for count in dict.fromkeys((lead, lead - 1, 0)):
        if 0 <= count < len(inverse):
            rows = grid_rows(inverse[count:])
            if rows is not None:
                return count, rows
    return 0, None


def grid_product(factors: Sequence[torch.Tensor], prefix: torch.Tensor | None = None) -> torch.Tensor:
    """F_0[i_0] F_1[i_1] ... for every combination (i_0, i_1, ...) in row-major order: (h, n_0 n_1 ..., m, b, b),
    after the rotations ``prefix`` (h, P, m, b, b) when given: (h, P + n_0 n_1 ..., m, b, b).

    Args:
        factors: per axis a, (h, n_a, m, b, b) blocks for each of its n_a values.
        prefix: rotations placed before the grid's (ComRoPE's rotated prefix tokens), in the one copy that lays
            the grid's out anyway.

    For each head and block, the products with the next axis are one batched matrix product: the partial products
    stacked as rows, (b G) x b, times the next factors side by side, b x (b n_a); plain autograd keeps only the
    small operands. About 4x faster than gathering every token's factors and multiplying them per token
    (forward and backward of ComRoPE-LD's rotations at 14 x 14).
    """
    heads, _, blocks, b, _ = factors[0].shape
    # partial products as (h m, b_i, G, b_j): rows (i, G) of one matrix per head and block
    prod = factors[0].permute(0, 2, 3, 1, 4)
    for factor in factors[1:]:
        count, size = factor.shape[1], prod.shape[3]
        right = factor.permute(0, 2, 3, 4, 1).reshape(heads * blocks, b, b * count)  # (h m, j, (k, n_a))
        out = torch.bmm(prod.reshape(heads * blocks, b * size, b), right).view(heads, blocks, b, size, b, count)
        prod = out.permute(0, 1, 2, 3, 5, 4).reshape(heads, blocks, b, size * count, b)  # (h, m, i, G', k)
    prod = prod.permute(0, 3, 1, 2, 4)  # (h, G, m, i, k)
    return prod.contiguous() if prefix is None else torch.cat((prefix.to(prod.dtype), prod), 1)


def _gathered_product(rows: tuple[torch.Tensor, ...], tables: Sequence[torch.Tensor]) -> torch.Tensor:
    """F_0 F_1 ... of the factors F_a = tables[a][:, rows[a]], (h, n, m, b, b) each."""
    product = None
    for table, index in zip(tables, rows, strict=True):
        factor = table.index_select(1, index)  # every token's row
        product = factor if product is None else product @ factor
    return product


class _GatheredProduct(torch.autograd.Function):
    """prod_a tables[a][:, rows[a]]: the per-axis exponentials gathered for every token and multiplied.

    Only the small tables are kept for the backward, which gathers the factors again, instead of holding each
    token's (h, n, m, b, b) factors from forward to backward (two 2.4 MB stacks per layer in ViT-S training).
    dF_a = (F_0 ... F_{a-1})^T dR (F_{a+1} ... F_{k-1})^T, summed into the table rows the tokens read.
    """

    @staticmethod
    def forward(ctx, rows: tuple[torch.Tensor, ...], *tables: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*rows, *tables)
        ctx.axes = len(tables)
        return _gathered_product(rows, tables)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        rows, tables = saved[: ctx.axes], saved[ctx.axes :]
        factors = [table.index_select(1, index) for table, index in zip(tables, rows, strict=True)]
        grads, suffix = [None] * len(factors), None  # suffix: F_{a+1} ... F_{k-1}
        for axis in reversed(range(len(factors))):
            part = grad if suffix is None else grad @ suffix.transpose(-1, -2)
            for factor in factors[:axis]:  # (F_0 ... F_{a-1})^T = F_{a-1}^T ... F_0^T: F_0^T goes on first
                part = factor.transpose(-1, -2) @ part
            grads[axis] = part
            if axis:  # the suffix of the next (lower) axis; none is left after axis 0
                suffix = factors[axis] if suffix is None else factors[axis] @ suffix
        table_grads = [
            torch.zeros_like(table).index_add_(1, index, part) if ctx.needs_input_grad[1 + axis] else None
            for axis, (table, index, part) in enumerate(zip(tables, rows, grads, strict=True))
        ]
        return None, *table_grads
