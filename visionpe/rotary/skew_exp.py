"""Block rotations R(p) = exp(sum_a p_a A_a) for Lie-group position encodings (LieRE, ComRoPE).

The generators A_a are b x b skew-symmetric blocks shared by every token, so the Taylor series of the exponent,
(sum_a p_a A_a)^k = sum_{|alpha| = k} p^alpha W_alpha, splits into token monomials p^alpha and matrices
W_alpha (the sum of all words in the A_a with letter counts alpha) that do not depend on the token. The
truncated series for every token is then one matrix product (N, T) @ (T, blocks * b * b) instead of N small
matrix exponentials, and the exact exponential follows by scaling and squaring: exp(M) = exp(M / 2^s)^(2^s),
with s set from a bound on the norm so that the truncation error stays below rounding. The series and
squarings run in fp64 (each squaring doubles the error), the result is fp32.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["skew_from_params", "linear_skew_expm", "apply_block_rotation"]

_ORDER = 12  # Taylor degree: theta^13 / 13! < 4e-8 for theta = 1.5
_THETA = 1.5  # largest norm bound evaluated by the series directly


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


@lru_cache(maxsize=16)
def _monomials(ndim: int, order: int) -> tuple[list[list[tuple[int, ...]]], list[list[list[int]]]]:
    """Exponent tuples alpha of each degree k <= order, and for each the index of alpha - e_a at degree k - 1."""
    levels: list[list[tuple[int, ...]]] = [[(0,) * ndim]]
    parents: list[list[list[int]]] = [[]]
    for _ in range(order):
        prev = {alpha: i for i, alpha in enumerate(levels[-1])}
        level = sorted({tuple(a + (j == axis) for j, a in enumerate(alpha)) for alpha in prev for axis in range(ndim)})
        levels.append(level)
        parents.append(
            [
                [prev.get(tuple(a - (j == axis) for j, a in enumerate(alpha)), -1) for alpha in level]
                for axis in range(ndim)
            ]
        )
    return levels, parents


def linear_skew_expm(generators: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """exp(sum_a coords[n, a] generators[g, a]) for every token n and block g, exactly (to fp32 rounding).

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
    if coords.ndim != 2 or coords.shape[1] != generators.shape[1]:
        raise ValueError(f"coords must have shape (N, ndim={generators.shape[1]}), got {tuple(coords.shape)}")
    num_blocks, ndim, b, _ = generators.shape
    with torch.autocast(coords.device.type, enabled=False):
        if b == 2:  # a 2 x 2 skew generator is a plane rotation: exact closed form
            angle = coords.float() @ generators[:, :, 1, 0].float().T  # (N, G)
            cos, sin = angle.cos(), angle.sin()
            return torch.stack((cos, -sin, sin, cos), dim=-1).view(*angle.shape, 2, 2)
        # fp64: each squaring doubles the error of the series, fp32 would lose 1e-5 after a few
        generators, coords = generators.double(), coords.double()
        # ||sum_a p_a A_a||_2 <= sum_a |p_a| ||A_a||_F: one squaring count s for all tokens and blocks
        norms = generators.detach().flatten(-2).norm(dim=-1)  # (G, ndim)
        bound = float((coords.detach().abs() @ norms.T).max()) if len(coords) else 0.0
        squarings = max(0, math.ceil(math.log2(bound / _THETA))) if bound > _THETA else 0
        coords = coords / 2**squarings

        levels, parents = _monomials(ndim, _ORDER)
        # words are stored (G, b, T, b): left-multiplying all T of them by A_a is one (b x b) @ (b x T b) bmm
        word = torch.eye(b, dtype=coords.dtype, device=coords.device).reshape(1, b, 1, b).repeat(num_blocks, 1, 1, 1)
        words = [word]
        for k in range(1, _ORDER + 1):
            prev = word.reshape(num_blocks, b, -1)
            word = generators.new_zeros(num_blocks, b, len(levels[k]), b)
            for axis in range(ndim):
                # a word of degree k is A_a times a word of degree k - 1 (first letter a)
                prod = (generators[:, axis] @ prev).view(num_blocks, b, -1, b)
                parent = torch.tensor(parents[k][axis], device=coords.device)
                keep = (parent >= 0).nonzero().squeeze(1)
                word = word.index_add(2, keep, prod.index_select(2, parent[keep]))
            word = word / k  # 1/k! accumulates level by level
            words.append(word)
        table = torch.cat(words, dim=2).permute(2, 0, 1, 3)  # (T, G, b, b)

        exponents = torch.tensor([alpha for level in levels for alpha in level], device=coords.device)  # (T, ndim)
        powers = coords.unsqueeze(-1) ** torch.arange(_ORDER + 1, device=coords.device)  # (N, ndim, K + 1)
        monomials = powers.gather(2, exponents.T.unsqueeze(0).expand(len(coords), -1, -1)).prod(1)  # (N, T)
        rot = (monomials @ table.reshape(table.shape[0], -1)).view(-1, num_blocks, b, b)
        for _ in range(squarings):
            rot = _small_matmul(rot, rot)
    return rot.float()


def _small_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for many tiny matrices as a sum of rank-one broadcast products.

    CPU bmm on thousands of 8 x 8 matrices is slow, and its backward copies every transposed operand.
    """
    out = a[..., :, :1] * b[..., :1, :]
    for j in range(1, a.shape[-1]):
        out = out + a[..., :, j : j + 1] * b[..., j : j + 1, :]
    return out


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
    if num_prefix_tokens:
        eye = torch.eye(b, dtype=rot.dtype, device=rot.device).expand(rot.shape[0], num_prefix_tokens, nblocks, b, b)
        rot = torch.cat((eye, rot), dim=1)
    cols = rot.to(x.dtype).transpose(-1, -2).contiguous()  # cols[..., j, :] is column j of R
    blocks = x.unflatten(-1, (nblocks, b))  # (..., heads, tokens, blocks, b)
    # R x as b broadcast multiply-adds over large tensors: CPU bmm on b x b matrices is slow
    out = blocks[..., :1] * cols[..., 0, :]
    for j in range(1, b):
        out = out + blocks[..., j : j + 1] * cols[..., j, :]
    return out.flatten(-2)
