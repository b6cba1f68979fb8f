"""Block rotations R(p) = exp(sum_a p_a A_a) for Lie-group position encodings (LieRE, ComRoPE), and their application.

The generators A_a are b x b skew-symmetric blocks shared by every token, so the Taylor series of the exponent,
(sum_a p_a A_a)^k = sum_{|alpha| = k} p^alpha W_alpha, splits into token monomials p^alpha and matrices
W_alpha (the sum of all words in the A_a with letter counts alpha) that do not depend on the token. The
truncated series for every token is then one matrix product (N, T) @ (T, blocks * b * b) instead of N small
matrix exponentials, and the exact exponential follows by scaling and squaring: exp(M) = exp(M / 2^s)^(2^s),
with s set from a bound on the spectral norm so that the truncation error stays below rounding. The count s is a
Python int read outside any compiled graph; under ``torch.export`` it is a tensor of the weights and each possible
squaring runs behind a ``torch.cond`` (:func:`_squaring_count`).

When the exponent of a block is a scalar times one fixed skew matrix (ComRoPE), exp((c1 + c2) S) =
exp(c1 S) exp(c2 S) and only the distinct values of each coordinate need an exponential
(:func:`block_skew_expm` with one axis, fp64: a small stack); the tokens then gather them.

Rotations are applied per b x b block as one batched matrix product whose batch is (head, token, block) and
whose rows are all images of the batch (q and k together): each small matrix is read once for 2 B vectors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "skew_from_params",
    "linear_skew_expm",
    "block_skew_expm",
    "block_skew_expm_chunks",
    "apply_block_rotation",
]

_ORDER = 12  # Taylor degree: theta^13 / 13! < 4e-8 for theta = 1.5
_THETA = 1.5  # largest spectral norm evaluated by the series directly
# squarings an exported graph can run (each behind a torch.cond): spectral norms up to 1.5 * 2^20 = 1.6e6
MAX_EXPORT_SQUARINGS = 20


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


def _build_monomials(
    ndim: int, order: int
) -> tuple[list[list[tuple[int, ...]]], list[list[tuple[list[int], list[int]]]]]:
    """Exponent tuples alpha of each degree k <= order, and for each degree k >= 1 and axis a the pairs
    (i, j) such that alpha_i - e_a is alpha_j of degree k - 1, as the lists ([i...], [j...]).

    Plain lists, so that the word table indexes with constants (no ``nonzero`` for torch.compile to trace); built
    once at import for 1, 2 and 3 axes (:data:`_MONOMIALS`), a constant that torch.compile reads without tracing.
    """
    levels: list[list[tuple[int, ...]]] = [[(0,) * ndim]]
    parents: list[list[tuple[list[int], list[int]]]] = [[]]
    for _ in range(order):
        prev = {alpha: i for i, alpha in enumerate(levels[-1])}
        level = sorted({tuple(a + (j == axis) for j, a in enumerate(alpha)) for alpha in prev for axis in range(ndim)})
        levels.append(level)
        pairs = []
        for axis in range(ndim):
            parent = [prev.get(tuple(a - (j == axis) for j, a in enumerate(alpha)), -1) for alpha in level]
            kept = [i for i, j in enumerate(parent) if j >= 0]
            pairs.append((kept, [parent[i] for i in kept]))
        parents.append(pairs)
    return levels, parents


_MONOMIALS = {ndim: _build_monomials(ndim, _ORDER) for ndim in (1, 2, 3)}


def _monomials(ndim: int) -> tuple[list[list[tuple[int, ...]]], list[list[tuple[list[int], list[int]]]]]:
    if ndim not in _MONOMIALS:  # more axes than the schemes use: built on first use
        _MONOMIALS[ndim] = _build_monomials(ndim, _ORDER)
    return _MONOMIALS[ndim]


def _word_table(generators: torch.Tensor) -> torch.Tensor:
    """(T, G, b, b) matrices W_alpha / |alpha|! for every monomial alpha of degree <= _ORDER, from (G, ndim, b, b)."""
    num_blocks, ndim, b, _ = generators.shape
    levels, parents = _monomials(ndim)
    # words are stored (G, b, T, b): left-multiplying all T of them by A_a is one (b x b) @ (b x T b) bmm
    word = torch.eye(b, dtype=generators.dtype, device=generators.device).reshape(1, b, 1, b)
    word = word.repeat(num_blocks, 1, 1, 1)
    words = [word]
    for k in range(1, _ORDER + 1):
        prev = word.reshape(num_blocks, b, -1)
        word = generators.new_zeros(num_blocks, b, len(levels[k]), b)
        for axis in range(ndim):
            # a word of degree k is A_a times a word of degree k - 1 (first letter a)
            prod = (generators[:, axis] @ prev).view(num_blocks, b, -1, b)
            kept, parent = (torch.tensor(i, dtype=torch.long, device=generators.device) for i in parents[k][axis])
            word = word.index_add(2, kept, prod.index_select(2, parent))
        word = word / k  # 1/k! accumulates level by level
        words.append(word)
    return torch.cat(words, dim=2).permute(2, 0, 1, 3)


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
    if coords.ndim != 2 or coords.shape[1] != generators.shape[2]:
        raise ValueError(f"coords must have shape (N, ndim={generators.shape[2]}), got {tuple(coords.shape)}")
    heads, blocks, ndim, b, _ = generators.shape
    device_type = coords.device.type
    if b == 2:  # a 2 x 2 skew generator is a plane rotation: exact closed form
        plane = generators[..., 1, 0].float()

        def plane_chunk(start: int, stop: int) -> torch.Tensor:
            with torch.autocast(device_type, enabled=False):
                angle = torch.einsum("na,hma->hnm", coords[start:stop].float(), plane)
                cos, sin = angle.cos(), angle.sin()
                return torch.stack((cos, -sin, sin, cos), dim=-1).view(*angle.shape, 2, 2)

        return plane_chunk
    with torch.autocast(device_type, enabled=False):
        gen, coords = generators.to(dtype).flatten(0, 1), coords.to(dtype)
        with torch.no_grad():
            # M = sum_a p_a A_a is skew: its eigenvalues come in pairs +-i lambda, so ||M||_2 <= ||M||_F / sqrt(2),
            # and ||M||_F^2 = p^T Gram p with Gram[a, c] = <A_a, A_c>: one squaring count s for all tokens and blocks
            gram = torch.einsum("gaij,gcij->gac", gen, gen)
            norm2 = torch.einsum("na,gac,nc->ng", coords, gram, coords)
            squarings = _squaring_count(norm2)
            del gram, norm2
        coords = coords / 2**squarings

        table = _word_table(gen)  # (T, H * M, b, b)
        table = table.reshape(len(table), heads, -1).transpose(0, 1)  # (H, T, M b b)
        levels, _ = _monomials(ndim)
        exponents = torch.tensor([alpha for level in levels for alpha in level], device=coords.device)  # (T, ndim)
        degrees = torch.arange(_ORDER + 1, device=coords.device)

    def series_chunk(start: int, stop: int) -> torch.Tensor:
        with torch.autocast(device_type, enabled=False):
            tokens = stop - start
            powers = coords[start:stop].unsqueeze(-1) ** degrees  # (n, ndim, K + 1)
            monomials = powers.gather(2, exponents.T.unsqueeze(0).expand(tokens, -1, -1)).prod(1)  # (n, T)
            # (n, T) @ (H, T, M b b): every token's series at once, already in the (H, n, M) layout
            rot = (monomials @ table).view(heads * tokens * blocks, b, b)
            del powers, monomials
            if isinstance(squarings, int):
                for _ in range(squarings):
                    rot = torch.bmm(rot, rot)
            else:  # exporting: the count is a tensor of the weights; each possible squaring is a torch.cond
                for i in range(MAX_EXPORT_SQUARINGS):
                    rot = torch.cond(squarings > i, _square, _unchanged, (rot,))
            return rot.view(heads, tokens, blocks, b, b).float()

    return series_chunk


def _squaring_count(norm2: torch.Tensor) -> int | torch.Tensor:
    """Squarings s with ||M||_2 / 2^s <= _THETA for every exponent M, from their squared Frobenius norms.

    A Python int in eager mode, and under torch.compile too: it is read outside the graph, so the compiled code
    depends on the count only, not on the weights (a training step does not recompile). Under ``torch.export``
    the count is a function of the weights, so it stays a 0-d tensor (at most :data:`MAX_EXPORT_SQUARINGS`)
    that the exported graph evaluates when it runs.
    """
    if torch.compiler.is_exporting():
        rho = (norm2.max().clamp(min=0) / 2).sqrt()
        return torch.ceil(torch.log2(rho / _THETA)).clamp(0, MAX_EXPORT_SQUARINGS)
    return _eager_squaring_count(norm2)


@torch.compiler.disable
def _eager_squaring_count(norm2: torch.Tensor) -> int:
    rho = math.sqrt(max(float(norm2.max()), 0.0) / 2) if norm2.numel() else 0.0
    return max(0, math.ceil(math.log2(rho / _THETA))) if rho > _THETA else 0


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


def apply_block_rotation(x: torch.Tensor, rot: torch.Tensor, num_prefix_tokens: int = 0) -> torch.Tensor:
    """Rotate channel blocks of ``x`` by per-token block rotations; prefix tokens are left as they are.

    Args:
        x: (..., num_heads, num_prefix_tokens + N, head_dim).
        rot: (num_heads | 1, N, head_dim // b, b, b) rotations (fp32; cast to x's dtype).
        num_prefix_tokens: leading tokens of ``x`` that are not rotated.

    Returns:
        Same shape and dtype as ``x``.
    """
    heads, tokens, head_dim = x.shape[-3:]
    nblocks, b = rot.shape[-3], rot.shape[-1]
    if rot.ndim != 5 or nblocks * b != head_dim or rot.shape[1] != tokens - num_prefix_tokens:
        raise ValueError(
            f"rot (num_heads, N, head_dim // b, b, b) = {tuple(rot.shape)} does not match x {tuple(x.shape)} "
            f"with {num_prefix_tokens} prefix tokens"
        )
    rot = rot.to(x.dtype)
    if num_prefix_tokens:
        # identity blocks for the prefix: tiny next to x, and the whole sequence stays one product
        eye = torch.eye(b, dtype=rot.dtype, device=rot.device).expand(rot.shape[0], num_prefix_tokens, nblocks, b, b)
        rot = torch.cat((eye, rot), dim=1)
    rot = rot.expand(heads, -1, -1, -1, -1)
    lead = x.shape[:-3]
    n = len(lead)
    # (..., heads, tokens, blocks, b) -> (heads, tokens, blocks, ..., b): one copy; rows are the images (and q, k)
    rows = x.unflatten(-1, (nblocks, b)).permute(n, n + 1, n + 2, *range(n), n + 3)
    rows = rows.reshape(heads * tokens * nblocks, -1, b)
    # row form of R v: v^T R^T, for every (head, token, block) at once
    out = torch.bmm(rows, rot.reshape(-1, b, b).transpose(1, 2))
    out = out.view(heads, tokens, nblocks, *lead, b).permute(*range(3, 3 + n), 0, 1, 2, 3 + n)
    return out.flatten(-2)
