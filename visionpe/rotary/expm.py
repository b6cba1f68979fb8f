"""Block rotations R(p) = exp(sum_a p_a A_a) for Lie-group position encodings (LieRE, ComRoPE).

The generators A_a are b x b skew-symmetric blocks shared by every token, so the powers of the exponent,
(sum_a p_a A_a)^k = sum_{|alpha| = k} p^alpha W_alpha, split into token monomials p^alpha and matrices
W_alpha (the sum of all words in the A_a with letter counts alpha) that do not depend on the token. A degree-12
polynomial of the exponent for every token is then one matrix product (N, T) @ (T, blocks * b * b) instead of N
small matrix exponentials, and the exact exponential follows by scaling and squaring: exp(M) = exp(M / 2^s)^(2^s),
with s set from a bound on the spectral norm so that the polynomial's error stays below rounding. The polynomial
is the Chebyshev truncation of exp on the imaginary segment that holds a skew matrix's eigenvalues
(:func:`_economized_exp`): as accurate on norms up to 2.8 as the Taylor polynomial is up to 1.5, so one squaring
fewer (LieRE in ViT-S: 4 instead of 5 per layer). The count s is a Python int in eager mode (one host read per
forward); in a traced graph it is a tensor of the weights (:func:`_squaring_count`), so that no host read splits
the graph: under ``torch.compile`` every possible squaring up to :data:`MAX_COMPILED_SQUARINGS` is computed and
kept only where the count asks for it (:class:`_SelectedSquarings`: eager's arithmetic, without control flow),
under ``torch.export`` each possible squaring runs behind a ``torch.cond``.

When the exponent of a block is a scalar times one fixed skew matrix (ComRoPE), exp((c1 + c2) S) =
exp(c1 S) exp(c2 S) and only the distinct values of each coordinate need an exponential
(:func:`block_skew_expm` with one axis, fp64: a small stack); the tokens then gather them.

Large stacks of small blocks (LieRE: 9,408 8 x 8 matrices per layer) are squared with the tokens last, as b
multiply-adds contiguous over the tokens (:func:`_token_last_matmul`), which on CPU is about twice as fast as a
batched gemm of 8 x 8 matrices.

Applying the rotations to q and k: :mod:`.block_rotation`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from .block_rotation import (
    TokenRotations,
    _check_qkv_rotation,
    _rotate_qkv,
    _rotate_qkv_backward,
    rotate_qkv_blocks_,
)

__all__ = [
    "skew_from_params",
    "linear_skew_expm",
    "block_skew_expm",
    "block_skew_expm_chunks",
    "block_skew_expm_layers",
    "LayerExponentials",
    "LayerRotations",
]

_ORDER = 12  # degree of the polynomial that stands for exp on the scaled exponent
_THETA = 2.8  # largest spectral norm evaluated by the polynomial directly


def _economized_exp(theta: float, order: int) -> tuple[float, ...]:
    """Monomial coefficients c_k of the degree-``order`` Chebyshev truncation of exp on the segment i[-theta, theta].

    A skew-symmetric M is normal with eigenvalues i lambda, |lambda| <= ||M||_2, so ||p(M) - exp(M)||_2 is the
    largest |p(i lambda) - exp(i lambda)| over them. The Jacobi-Anger expansion exp(i theta t) = sum_k eps_k i^k
    J_k(theta) T_k(t) (eps_0 = 1, eps_k = 2) cut at degree 12 errs by at most 2.3e-8 for theta = 2.8, less than the
    Taylor polynomial of the same degree does on [-1.5, 1.5] (3.1e-8): one squaring fewer for the same accuracy.
    Rewritten in z = i theta t the coefficients are real; c_k k! = 1 up to k = 6 within 5e-5 (0.85 for k = 11).
    """

    def bessel(k: int) -> float:  # J_k(theta) by its power series (40 terms: exact in double for theta < 10)
        half = theta / 2
        return sum((-1) ** m * half ** (2 * m + k) / (math.factorial(m) * math.factorial(m + k)) for m in range(40))

    cheb = [[1], [0, 1]]  # monomial coefficients of T_k in t: T_{k+1} = 2 t T_k - T_{k-1}
    while len(cheb) <= order:
        cheb.append([2 * c for c in [0, *cheb[-1]]])
        for n, c in enumerate(cheb[-3]):
            cheb[-1][n] -= c
    coeffs = [0.0] * (order + 1)
    for k in range(order + 1):
        weight = bessel(k) * (1 if k == 0 else 2)
        for n, tau in enumerate(cheb[k]):
            if tau:  # i^k T_k(t) with t = -i z / theta: i^(k - n) = (-1)^((k - n) / 2), k - n even
                coeffs[n] += weight * tau * (-1) ** ((k - n) // 2) / theta**n
    return tuple(coeffs)


# c_k k!: the word table holds W_alpha / |alpha|!, and each token's monomials are scaled by these per degree
_DEGREE_SCALE = tuple(c * math.factorial(k) for k, c in enumerate(_economized_exp(_THETA, _ORDER)))
# squarings an exported graph can run (each behind a torch.cond): spectral norms up to 2.8 * 2^20 = 2.9e6
MAX_EXPORT_SQUARINGS = 20
# squarings a compiled graph runs, every one of them (:class:`_SelectedSquarings`): spectral norms up to
# 2.8 * 2^16 = 1.8e5 get eager's count. The norms that occur need far fewer: LieRE at its initialisation takes 4
# squarings on a 14 x 14 grid, 7 on 64 x 64 and 9 on 256 x 256 (integer positions), ComRoPE 2 to 4 (positions
# normalised to the grid); and in LieRE's fp32 each squaring doubles the rounding error, so past 12 squarings
# (2^12 * 6e-8 = 2.4e-4) eager's own rotations lose 1e-4 accuracy long before the 16 run out. A larger norm is
# clamped to 16 squarings: its polynomial is then evaluated beyond the segment where it stands for exp.
MAX_COMPILED_SQUARINGS = 16


def skew_from_params(params: torch.Tensor, block_size: int) -> torch.Tensor:
    """Skew-symmetric blocks U - U^T from their strictly-upper-triangular entries (row-major).

    Args:
        params: (..., b (b - 1) / 2) entries of U = triu(., 1).
        block_size: b.

    Returns:
        (..., b, b) skew-symmetric matrices.

    Example:
        >>> skew_from_params(torch.tensor([2.0]), 2)
        tensor([[ 0.,  2.],
                [-2.,  0.]])
    """
    count = block_size * (block_size - 1) // 2
    if params.shape[-1] != count:
        raise ValueError(f"params must end in b (b - 1) / 2 = {count} entries for b={block_size}, got {params.shape}")
    rows, cols = torch.triu_indices(block_size, block_size, 1, device=params.device)
    upper = params.new_zeros(*params.shape[:-1], block_size, block_size)
    upper[..., rows, cols] = params
    return upper - upper.transpose(-1, -2)


# per degree: the exponent tuples alpha; and per degree and axis, the runs (i, j, n) of :func:`_build_monomials`
_Monomials = tuple[list[list[tuple[int, ...]]], list[list[list[tuple[int, int, int]]]]]


def _build_monomials(ndim: int, order: int) -> _Monomials:
    """Exponent tuples alpha of each degree k <= order, and for each degree k >= 1 and axis a the runs
    (i, j, n): alpha_{i + r} - e_a is alpha_{j + r} of degree k - 1 for r < n (indices within their degrees).

    Every word of degree k - 1 followed by any letter is a word of degree k, so each axis's runs cover all
    indices of degree k - 1 once. Plain tuples of ints, so that the word table slices with constants (no
    ``nonzero`` or index tensor for torch.compile to trace); built once at import for 1, 2 and 3 axes
    (:data:`_MONOMIALS`): one run per axis for 1 and 2 axes; for 3, one for the first axis and k for each other.
    """
    levels: list[list[tuple[int, ...]]] = [[(0,) * ndim]]
    runs: list[list[list[tuple[int, int, int]]]] = [[]]
    for _ in range(order):
        prev = {alpha: i for i, alpha in enumerate(levels[-1])}
        level = sorted({tuple(a + (j == axis) for j, a in enumerate(alpha)) for alpha in prev for axis in range(ndim)})
        levels.append(level)
        level_runs = []
        for axis in range(ndim):
            axis_runs: list[list[int]] = []
            for i, alpha in enumerate(level):
                j = prev.get(tuple(a - (c == axis) for c, a in enumerate(alpha)))
                if j is None:
                    continue
                if axis_runs and axis_runs[-1][0] + axis_runs[-1][2] == i and axis_runs[-1][1] + axis_runs[-1][2] == j:
                    axis_runs[-1][2] += 1
                else:
                    axis_runs.append([i, j, 1])
            level_runs.append([(i, j, n) for i, j, n in axis_runs])
        runs.append(level_runs)
    return levels, runs


_MONOMIALS = {ndim: _build_monomials(ndim, _ORDER) for ndim in (1, 2, 3)}


def _monomials(ndim: int) -> _Monomials:
    if ndim not in _MONOMIALS:  # more axes than the schemes use: built on first use
        _MONOMIALS[ndim] = _build_monomials(ndim, _ORDER)
    return _MONOMIALS[ndim]


def _word_table(generators: torch.Tensor) -> torch.Tensor:
    """(G, T, b, b) matrices W_alpha / |alpha|! for every monomial alpha of degree <= _ORDER, from (G, ndim, b, b).

    A word of degree k is a word of degree k - 1 times its last letter A_a, so right-multiplying all the words of a
    degree by every A_a at once is one (T_{k-1} b x b) @ (b x ndim b) bmm per block, whose products are summed
    into the words of degree k by constant slices (:func:`_build_monomials`' runs). :class:`_WordTable` writes
    every degree into one preallocated table and has its own backward (the same recursion run down): for LieRE's
    ViT-S (all layers: 576 blocks, 91 words) forward and backward take about half the time autograd took through
    out-of-place index adds, zero-filled tensors and a concatenation.
    """
    return _WordTable.apply(generators)


class _WordTable(torch.autograd.Function):
    """:func:`_word_table`; saves the table and the letters, and its backward runs the degrees down: the gradient
    of the products of degree k is gathered from the words' by the runs, then one bmm each gives the gradient of
    the words of degree k - 1 (added to theirs) and of the letters."""

    @staticmethod
    def forward(ctx, generators: torch.Tensor) -> torch.Tensor:
        num_blocks, ndim, b, _ = generators.shape
        levels, runs = _monomials(ndim)
        starts = [0]
        for level in levels:
            starts.append(starts[-1] + len(level))
        letters = generators.transpose(1, 2).reshape(num_blocks, b, ndim * b)  # [A_0 | A_1 | ...] side by side
        table = generators.new_empty(num_blocks, starts[-1], b, b)
        table[:, 0] = torch.eye(b, dtype=generators.dtype, device=generators.device)
        for k in range(1, len(levels)):
            prev = table[:, starts[k - 1] : starts[k]].reshape(num_blocks, -1, b)
            prod = torch.bmm(prev, letters).view(num_blocks, -1, b, ndim, b)  # (G, T_{k-1}, b, ndim, b)
            word = table[:, starts[k] : starts[k + 1]].zero_()
            for axis, axis_runs in enumerate(runs[k]):
                for i, j, n in axis_runs:
                    word[:, i : i + n].add_(prod[:, j : j + n, :, axis], alpha=1 / k)  # 1/k! accumulates
        ctx.save_for_backward(table, letters)
        ctx.ndim, ctx.starts = ndim, starts
        return table

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        table, letters = ctx.saved_tensors
        ndim, starts = ctx.ndim, ctx.starts
        num_blocks, _, b, _ = table.shape
        _, runs = _monomials(ndim)
        letters_t = letters.transpose(1, 2).contiguous()
        grad_letters = torch.zeros_like(letters)
        # the gradient of the words of degree k: the incoming one for the top degree; below, the incoming one plus
        # what the degree above passes down (a new tensor per degree: ``grad`` itself is only read)
        grad_word = grad[:, starts[-2] :]
        for k in range(len(starts) - 2, 0, -1):
            count = starts[k] - starts[k - 1]
            grad_prod = grad.new_empty(num_blocks, count, b, ndim, b)
            for axis, axis_runs in enumerate(runs[k]):
                for i, j, n in axis_runs:
                    grad_prod[:, j : j + n, :, axis] = grad_word[:, i : i + n]
            grad_prod = grad_prod.view(num_blocks, count * b, ndim * b)
            prev = table[:, starts[k - 1] : starts[k]].reshape(num_blocks, -1, b)
            grad_letters.baddbmm_(prev.transpose(1, 2), grad_prod, alpha=1 / k)
            if k > 1:  # the identity of degree 0 is a constant
                own = grad[:, starts[k - 1] : starts[k]].reshape(num_blocks, -1, b)
                grad_word = torch.baddbmm(own, grad_prod, letters_t, alpha=1 / k).view(num_blocks, count, b, b)
        return grad_letters.view(num_blocks, b, ndim, b).transpose(1, 2)


def block_skew_expm(generators: torch.Tensor, coords: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """exp(sum_a coords[n, a] generators[h, j, a]) for every head h, token n and block j.

    Args:
        generators: (H, M, ndim, b, b) skew-symmetric generators (e.g. heads x blocks).
        coords: (N, ndim) token positions.
        dtype: working precision of the series and the squarings (the result is fp32). Each squaring doubles
            the error before it: fp32 (torch.linalg.matrix_exp's accuracy) ends near 2^s * 1e-7, which breaks
            the exact relative property of commuting generators at 1e-5; fp64 ends at fp32 rounding.

    Returns:
        (H, N, M, b, b) float32 rotations, the layout :func:`apply_block_rotation` reads.
    """
    return block_skew_expm_chunks(generators, coords, dtype)(0, len(coords))


def block_skew_expm_chunks(
    generators: torch.Tensor, coords: torch.Tensor, dtype: torch.dtype = torch.float64
) -> Callable[[int, int], torch.Tensor]:
    """:func:`block_skew_expm` by token ranges: ``fn(start, stop)`` is ``block_skew_expm(...)[:, start:stop]``.

    The word table and the squaring count (from the largest norm over *all* tokens) are set up once, so every
    chunk runs the same series as the whole; only the (H, stop - start, M, b, b) rotations of the chunk (and its
    fp64 intermediates) exist at a time.
    """
    if generators.ndim != 5 or generators.shape[-1] != generators.shape[-2]:
        raise ValueError(f"generators must have shape (H, M, ndim, b, b), got {tuple(generators.shape)}")
    return functools.partial(block_skew_expm_layers(generators.unsqueeze(0), coords, dtype), 0)


def block_skew_expm_layers(
    generators: torch.Tensor, coords: torch.Tensor, dtype: torch.dtype = torch.float64
) -> LayerExponentials:
    """:func:`block_skew_expm_chunks` for a stack of layers: ``fn(layer, start, stop)`` is
    ``block_skew_expm(generators[layer], coords, dtype)[:, start:stop]`` (a :class:`LayerExponentials`).

    Args:
        generators: (L, H, M, ndim, b, b) skew-symmetric generators of L layers.
        coords: (N, ndim) token positions.
        dtype: as :func:`block_skew_expm`.
    """
    return LayerExponentials(generators, coords, dtype)


class LayerExponentials:
    """exp(sum_a coords[n, a] generators[l, h, j, a]) for a stack of L layers at fixed token positions, built by
    layer and token range: ``self(layer, start, stop)`` is ``block_skew_expm(generators[layer], coords,
    dtype)[:, start:stop]``, and ``self.layer(i)`` the :class:`~visionpe.rotary.block_rotation.TokenRotations` of
    layer ``i``.

    What does not depend on the tokens is set up once for all layers at construction: the word tables (one short
    recursion over the (L H M) generators instead of one per layer) and the norms that set each layer's squaring
    count. 2 x 2 generators are plane rotations and take the exact closed form instead.

    Args:
        generators: (L, H, M, ndim, b, b) skew-symmetric generators of L layers.
        coords: (N, ndim) token positions.
        dtype: as :func:`block_skew_expm`.
        norm2: (L, n) squared Frobenius norms whose largest per layer sets that layer's squaring count; None (the
            default): those of its own exponents. A larger bound only adds squarings, so that exponentials split
            into several stacks can share the count of their union (ComRoPE-LD's axes in a traced graph).
    """

    def __init__(
        self,
        generators: torch.Tensor,
        coords: torch.Tensor,
        dtype: torch.dtype = torch.float64,
        norm2: torch.Tensor | None = None,
    ) -> None:
        if generators.ndim != 6 or generators.shape[-1] != generators.shape[-2]:
            raise ValueError(f"generators must have shape (L, H, M, ndim, b, b), got {tuple(generators.shape)}")
        if coords.ndim != 2 or coords.shape[1] != generators.shape[3]:
            raise ValueError(f"coords must have shape (N, ndim={generators.shape[3]}), got {tuple(coords.shape)}")
        if norm2 is not None and (norm2.ndim != 2 or len(norm2) != generators.shape[0]):
            raise ValueError(f"norm2 must have shape (L={generators.shape[0]}, n), got {tuple(norm2.shape)}")
        layers, heads, blocks, ndim, b, _ = generators.shape
        self.num_layers, self.heads, self.blocks, self.block_size = layers, heads, blocks, b
        self.num_tokens, self.device_type = len(coords), coords.device.type
        #: squared tokens-last with the fused square-and-rotate step (:meth:`rotate_qkv_`)
        self.token_last = False
        if b == 2:  # a 2 x 2 skew generator is a plane rotation: exact closed form
            self.plane, self.coords = generators[..., 1, 0].float(), coords
            return
        self.plane = None
        with torch.autocast(self.device_type, enabled=False):
            gen, coords = generators.to(dtype).flatten(0, 2), coords.to(dtype)
            with torch.no_grad():
                # M = sum_a p_a A_a is skew: its eigenvalues come in pairs +-i lambda, so ||M||_2 <= ||M||_F /
                # sqrt(2), and ||M||_F^2 = p^T Gram p with Gram[a, c] = <A_a, A_c>: one squaring count per layer,
                # for all its tokens and blocks
                if norm2 is None:
                    gram = torch.einsum("gaij,gcij->gac", gen, gen)
                    norm2 = torch.einsum("na,gac,nc->gn", coords, gram, coords).reshape(layers, -1)
                    del gram
                self.norm2 = norm2
            # every layer's count read at once: one device-to-host read per forward instead of one per layer (on a
            # GPU each read waits for the queue to drain). Under torch.compile and torch.export the counts are
            # computed in the graph, per layer (see _squaring_count)
            traced = torch.compiler.is_compiling() or torch.compiler.is_exporting()
            self.counts = None if traced else _eager_squaring_counts(self.norm2)

            table = _word_table(gen)  # (L H M, T, b, b)
            # token-last squarings pay off for large stacks of small blocks; small stacks (ComRoPE's per-value
            # exponentials) are cheaper as one bmm per squaring than as b multiply-adds. Eager only: a traced
            # graph's count is a tensor, squared by bmm (_SelectedSquarings or torch.cond)
            self.token_last = (
                not traced
                and self.device_type in _TOKEN_LAST_DEVICES
                and b <= _TOKEN_LAST_MAX_BLOCK
                and heads * blocks * len(coords) >= _TOKEN_LAST_MIN_STACK
            )
            if self.token_last:  # per layer (H M, T, b b): the series comes out as (H, M, b, b, n), the squarings'
                self.tables = table.view(layers, heads * blocks, -1, b * b).unbind(0)
            else:  # per layer (H, T, M b b)
                self.tables = table.view(layers, heads, blocks, -1, b * b).transpose(2, 3).flatten(3).unbind(0)
            levels, _ = _monomials(ndim)
            # (T, ndim) exponents of the monomials
            self.exponents = torch.tensor([alpha for level in levels for alpha in level], device=coords.device)
            # (T,) c_|alpha| |alpha|!: with the table's W_alpha / |alpha|!, the product sums c_k (sum_a p_a A_a)^k
            scale = torch.tensor([_DEGREE_SCALE[k] for k, level in enumerate(levels) for _ in level], dtype=dtype)
            self.scale = scale.to(coords.device)
            self.degrees = torch.arange(_ORDER + 1, device=coords.device)
            self.coords = coords

    def layer(self, index: int) -> LayerRotations:
        """The rotations of layer ``index`` (the last layer's when the stack is shorter: generators shared by all)."""
        return LayerRotations(self, min(index, self.num_layers - 1))

    def _series(self, layer: int, start: int, stop: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        """(the polynomial of the scaled exponents of tokens [start, stop), the layer's squaring count)."""
        # under compile read per layer, so that a compiled graph depends on its own layer's count only
        tokens, heads, blocks, b = stop - start, self.heads, self.blocks, self.block_size
        squarings = self.counts[layer] if self.counts is not None else _squaring_count(self.norm2[layer])
        powers = (self.coords[start:stop] / 2**squarings).unsqueeze(-1) ** self.degrees  # (n, ndim, K + 1)
        monomials = powers.gather(2, self.exponents.T.unsqueeze(0).expand(tokens, -1, -1)).prod(1) * self.scale
        if self.token_last:
            # (H M, b b, T) @ (T, n): every token's series at once, tokens last for the squarings
            series = self.tables[layer].transpose(1, 2) @ monomials.T
            return series.view(heads, blocks, b, b, tokens), squarings
        # (n, T) @ (H, T, M b b): every token's series at once, already in the (H, n, M) layout
        return (monomials @ self.tables[layer]).view(heads * tokens * blocks, b, b), squarings

    def __call__(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """(H, stop - start, M, b, b) fp32 rotations of tokens [start, stop) in layer ``layer``."""
        with torch.autocast(self.device_type, enabled=False):
            if self.plane is not None:
                angle = torch.einsum("na,hma->hnm", self.coords[start:stop].float(), self.plane[layer])
                cos, sin = angle.cos(), angle.sin()
                return torch.stack((cos, -sin, sin, cos), dim=-1).view(*angle.shape, 2, 2)
            rot, squarings = self._series(layer, start, stop)
            if self.token_last:  # squared tokens-last, returned as the (H, n, M, b, b) rotations
                return _TokenLastSquarings.apply(rot, squarings).float()
            if isinstance(squarings, int):
                for _ in range(squarings):
                    rot = torch.bmm(rot, rot)
            elif torch.compiler.is_exporting():  # the count is a tensor; each possible squaring is a torch.cond
                for i in range(MAX_EXPORT_SQUARINGS):
                    rot = torch.cond(squarings > i, _square, _unchanged, (rot,))
            else:  # compiling: every possible squaring, kept where the count asks for it
                rot = _SelectedSquarings.apply(rot, squarings)
            return rot.view(self.heads, stop - start, self.blocks, self.block_size, self.block_size).float()

    def rotate_qkv_(
        self, layer: int, qkv: torch.Tensor, num_heads: int, num_prefix_tokens: int = 0, tokens: int | None = None
    ) -> torch.Tensor:
        """:func:`~visionpe.rotary.block_rotation.rotate_qkv_blocks_` of ``qkv`` by the rotations of all tokens of
        ``layer``: with tokens-last squarings (:attr:`token_last`), the squarings and the rotation in one step whose
        backward squares the series again, so that the rotations are not kept from forward to backward either (in
        LieRE's ViT-S: 2.4 MB fewer per block); otherwise the rotations are built, then applied."""
        if not self.token_last:
            return rotate_qkv_blocks_(qkv, self(layer, 0, self.num_tokens), num_heads, num_prefix_tokens, tokens)
        shape = (self.heads, self.num_tokens, self.blocks, self.block_size, self.block_size)
        tokens = _check_qkv_rotation(qkv, shape, num_heads, num_prefix_tokens, tokens)
        with torch.autocast(self.device_type, enabled=False):
            rot, squarings = self._series(layer, 0, self.num_tokens)
        return _SquaredQKVRotation.apply(qkv, rot, squarings, num_heads, num_prefix_tokens, tokens)


class LayerRotations(TokenRotations):
    """The rotations of one layer of a :class:`LayerExponentials`."""

    def __init__(self, exponentials: LayerExponentials, layer: int) -> None:
        self.exponentials, self.index, self.num_tokens = exponentials, layer, exponentials.num_tokens

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        return self.exponentials(self.index, start, stop)

    def rotate_qkv_(self, qkv: torch.Tensor, num_heads: int, num_prefix_tokens: int, tokens: int) -> torch.Tensor:
        return self.exponentials.rotate_qkv_(self.index, qkv, num_heads, num_prefix_tokens, tokens)


_TOKEN_LAST_MAX_BLOCK = 16  # block sizes squared tokens-last (elementwise over the tokens); larger blocks use bmm
_TOKEN_LAST_MIN_STACK = 2048  # and only stacks of at least this many matrices per layer
# and only on these devices: on CPU b multiply-adds beat bmm's per-matrix gemm calls; on a GPU one batched gemm
# per squaring is one kernel launch instead of b (measured on an H200 in bf16 ViT-S training)
_TOKEN_LAST_DEVICES = ("cpu",)


def _token_last_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[..., i, k, :] (+)= sum_j a[..., i, j, :] * b[..., j, k, :] for stacks of small matrices stored with
    the tokens last, (..., n, n, tokens); accumulates into ``out`` when given.

    n multiply-adds, each contiguous along the tokens: on CPU about twice as fast as torch.bmm of the
    (G, n, n) stack for n = 8, whose per-matrix gemm calls dominate. Transposed operands are views; the
    columns of ``a`` and rows of ``b`` come from one ``unbind`` each (8% faster than indexing them one by one).
    """
    cols, rows = a.unsqueeze(-2).unbind(-3), b.unsqueeze(-4).unbind(-3)  # a[..., :, j, None, :], b[..., None, j]
    start = 0
    if out is None:
        out, start = cols[0] * rows[0], 1
    for j in range(start, len(cols)):
        out.addcmul_(cols[j], rows[j])
    return out


def _token_major(stack: torch.Tensor) -> torch.Tensor:
    """A tokens-last (H, M, b, b, n) stack as the contiguous (H, n, M, b, b) rotations the block product reads."""
    return stack.permute(0, 4, 1, 2, 3).contiguous()


def _tokens_last(rot: torch.Tensor) -> torch.Tensor:
    """(H, n, M, b, b) rotations (or their gradient) as a contiguous tokens-last (H, M, b, b, n) stack."""
    return rot.permute(0, 2, 3, 4, 1).contiguous()


def _squared(rot: torch.Tensor, count: int) -> torch.Tensor:
    """S^(2^count) of a tokens-last (H, M, b, b, n) stack S, as the contiguous (H, n, M, b, b) rotations."""
    for _ in range(count):
        rot = _token_last_matmul(rot, rot)
    return _token_major(rot)


def _square_chain(rot: torch.Tensor, count: int) -> list[torch.Tensor]:
    """[S, S^2, S^4, ..., S^(2^count)] of a tokens-last (..., b, b, n) stack S."""
    chain = [rot]
    for _ in range(count):
        chain.append(_token_last_matmul(chain[-1], chain[-1]))
    return chain


def _square_chain_backward(chain: list[torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
    """dL/dS from dL/d(S^(2^count)) and ``chain`` = [S, ..., S^(2^(count - 1))], all tokens-last: for Y = R R,
    dR = dY R^T + R^T dY."""
    for rot in reversed(chain):
        rot_t = rot.transpose(-3, -2)
        grad = _token_last_matmul(rot_t, grad, out=_token_last_matmul(grad, rot_t))
    return grad


class _TokenLastSquarings(torch.autograd.Function):
    """``count`` squarings of an (H, M, b, b, n) stack stored tokens-last, returned as a contiguous
    (H, n, M, b, b), the token-major layout :func:`apply_block_rotation` multiplies in (one copy).

    Only the series is saved: the backward squares it again (cheap next to keeping ``count`` more stacks alive
    until the backward, which costs memory and, on CPU, fresh pages).
    """

    @staticmethod
    def forward(ctx, rot: torch.Tensor, count: int) -> torch.Tensor:
        ctx.save_for_backward(rot)
        ctx.count = count
        return _squared(rot, count)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rot,) = ctx.saved_tensors
        chain = _square_chain(rot, ctx.count - 1) if ctx.count else []
        return _square_chain_backward(chain, _tokens_last(grad)), None


class _SquaredQKVRotation(torch.autograd.Function):
    """:class:`_TokenLastSquarings` then :class:`_QKVBlockRotation` in one step that keeps only the series and
    the (rotated) projection output: the backward squares the series again, up to the rotations themselves
    (one product more than the squarings' backward needs), instead of holding the rotations from forward to
    backward."""

    @staticmethod
    def forward(
        ctx, qkv: torch.Tensor, rot: torch.Tensor, count: int, num_heads: int, prefix: int, tokens: int
    ) -> torch.Tensor:
        _rotate_qkv(qkv, _squared(rot, count).flatten(0, 2).to(qkv.dtype), num_heads, prefix, tokens)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(qkv, rot)
        ctx.count, ctx.layout = count, (num_heads, prefix, tokens)
        return qkv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qkv, rot = ctx.saved_tensors
        chain = _square_chain(rot, ctx.count)
        mats = _token_major(chain.pop())  # R, (H, n, M, b, b)
        shape = mats.shape
        mats = mats.flatten(0, 2).to(qkv.dtype)
        grad_qkv, grad_mats = _rotate_qkv_backward(grad, qkv, mats, *ctx.layout, *ctx.needs_input_grad[:2])
        grad_rot = None
        if grad_mats is not None:
            grad_rot = _square_chain_backward(chain, _tokens_last(grad_mats.to(rot.dtype).view(shape)))
        return grad_qkv, grad_rot, None, None, None, None


def _squaring_count(norm2: torch.Tensor) -> int | torch.Tensor:
    """Squarings s with ||M||_2 / 2^s <= _THETA for every exponent M of a layer, from their squared Frobenius norms.

    A Python int in eager mode (:func:`_eager_squaring_count`). In a traced graph a 0-d tensor of the weights,
    the same count computed on the device, so that no host read splits the graph and new weights need no new
    graph: at most :data:`MAX_COMPILED_SQUARINGS` under ``torch.compile`` (:class:`_SelectedSquarings` runs them
    all), at most :data:`MAX_EXPORT_SQUARINGS` under ``torch.export`` (each behind a ``torch.cond``).
    """
    if torch.compiler.is_exporting():
        return _traced_squaring_count(norm2, MAX_EXPORT_SQUARINGS)
    if torch.compiler.is_compiling():
        return _traced_squaring_count(norm2, MAX_COMPILED_SQUARINGS)
    return _eager_squaring_count(norm2)


def _traced_squaring_count(norm2: torch.Tensor, maximum: int) -> torch.Tensor:
    """:func:`_eager_squaring_count` as a 0-d tensor in the dtype of ``norm2``, clamped to ``maximum``."""
    largest = norm2.max() if norm2.numel() else norm2.new_zeros(())
    rho = (largest.clamp(min=0) / 2).sqrt()
    return torch.ceil(torch.log2(rho / _THETA)).clamp(0, maximum)  # log2(0) = -inf: clamped to 0 squarings


@torch.compiler.disable
def _eager_squaring_counts(norm2: torch.Tensor) -> list[int]:
    """:func:`_eager_squaring_count` of every layer of (L, n) squared norms, from one device-to-host copy."""
    if not norm2.shape[-1]:
        return [0] * len(norm2)
    return [_eager_squaring_count(row) for row in norm2.amax(-1, keepdim=True).cpu()]


@torch.compiler.disable
def _eager_squaring_count(norm2: torch.Tensor) -> int:
    rho = math.sqrt(max(float(norm2.max()), 0.0) / 2) if norm2.numel() else 0.0
    return max(0, math.ceil(math.log2(rho / _THETA))) if rho > _THETA else 0


def _selected_chain(rot: torch.Tensor, count: torch.Tensor, length: int) -> list[torch.Tensor]:
    """[R_0, ..., R_length] with R_0 = ``rot`` and R_{i + 1} = R_i R_i where i < ``count``, else R_i."""
    chain = [rot]
    for i in range(length):
        chain.append(torch.where(count > i, torch.bmm(chain[-1], chain[-1]), chain[-1]))
    return chain


class _SelectedSquarings(torch.autograd.Function):
    """R^(2^count) of a (G, b, b) stack R for a 0-d tensor ``count`` <= :data:`MAX_COMPILED_SQUARINGS`, without
    reading the count on the host (a compiled graph stays whole, CUDA graphs included): each of the
    :data:`MAX_COMPILED_SQUARINGS` squarings is computed and kept only where i < count, so the result is eager's
    ``count`` squarings (the unused ones cost a bmm of the stack each; positions are shared by the batch, so
    this is work per forward, not per image).

    Only R is saved: the backward squares it again (dR = dY R^T + R^T dY for Y = R R, where the squaring was
    kept), instead of holding the :data:`MAX_COMPILED_SQUARINGS` stacks from forward to backward.
    """

    @staticmethod
    def forward(ctx, rot: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rot, count)
        return _selected_chain(rot, count, MAX_COMPILED_SQUARINGS)[-1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rot, count = ctx.saved_tensors
        chain = _selected_chain(rot, count, MAX_COMPILED_SQUARINGS - 1)  # the input of every squaring
        for i in reversed(range(MAX_COMPILED_SQUARINGS)):
            rot_t = chain[i].transpose(-1, -2)
            grad = torch.where(count > i, torch.baddbmm(torch.bmm(grad, rot_t), rot_t, grad), grad)
        return grad, None


def _square(rot: torch.Tensor) -> torch.Tensor:
    return torch.bmm(rot, rot)


def _unchanged(rot: torch.Tensor) -> torch.Tensor:
    return rot.clone()  # torch.cond branches may not return their input


def linear_skew_expm(generators: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """exp(sum_a coords[n, a] generators[g, a]) for every token n and block g, exactly (to fp32 rounding).

    The series and squarings run in fp64, as in the models (:func:`block_skew_expm`).

    Args:
        generators: (G, ndim, b, b) skew-symmetric generators (G independent blocks, e.g. heads x blocks).
        coords: (N, ndim) token positions.

    Returns:
        (N, G, b, b) float32 rotations.

    Example:
        >>> gen = torch.tensor([[[[0.0, -1.0], [1.0, 0.0]]]])
        >>> linear_skew_expm(gen, torch.tensor([[math.pi / 2]])).squeeze().abs().round(decimals=5)
        tensor([[0., 1.],
                [1., 0.]])
    """
    if generators.ndim != 4 or generators.shape[-1] != generators.shape[-2]:
        raise ValueError(f"generators must have shape (G, ndim, b, b), got {tuple(generators.shape)}")
    return block_skew_expm(generators.unsqueeze(0), coords, torch.float64).squeeze(0)
