"""Patch dropout's kept tokens: moving per-token tensors between the kept subset and the full sequence.

With patch dropout each sample keeps its own tokens, given as ``keep`` (B, K): int64 indices into the full
sequence of ``num_tokens`` tokens (prefix tokens included). Positions, rotations and biases are those of the full
grid, gathered at the kept indices, so a kept patch is encoded exactly as it would be without dropout.
"""

from __future__ import annotations

import torch

__all__ = ["scatter_tokens", "gather_tokens", "gather_pairs", "scatter_pairs"]


def _token_index(keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``keep`` (B, K) as a gather/scatter index along dim -2 of x (..., B, heads, K | N, D)."""
    return keep.view(keep.shape[0], 1, keep.shape[1], 1).expand(*x.shape[:-2], keep.shape[1], x.shape[-1])


def scatter_tokens(x: torch.Tensor, keep: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Kept tokens x (..., B, heads, K, D) on the full sequence (..., B, heads, num_tokens, D), dropped rows zero.

    Example:
        >>> scatter_tokens(torch.ones(1, 1, 2, 1), torch.tensor([[0, 2]]), 3).flatten()
        tensor([1., 0., 1.])
    """
    full = x.new_zeros(*x.shape[:-2], num_tokens, x.shape[-1])
    return full.scatter(-2, _token_index(keep, x), x)


def gather_tokens(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The kept rows (..., B, heads, K, D) of full-sequence tokens x (..., B, heads, num_tokens, D)."""
    return x.gather(-2, _token_index(keep, x[..., : keep.shape[1], :]))


def gather_pairs(bias: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A full-sequence bias (B | 1, heads | 1, T, T) at the kept pairs: (B, heads | 1, K, K)."""
    (batch, count), heads, total = keep.shape, bias.shape[1], bias.shape[-1]
    rows = bias.expand(batch, heads, total, total).gather(2, keep.view(batch, 1, count, 1).expand(-1, heads, -1, total))
    return rows.gather(3, keep.view(batch, 1, 1, count).expand(-1, heads, count, -1))


def scatter_pairs(attn: torch.Tensor, keep: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Probabilities over the kept pairs (B, heads, K, K) on the full sequence (B, heads, T, T), zero elsewhere."""
    (batch, count), heads = keep.shape, attn.shape[1]
    cols = attn.new_zeros(batch, heads, count, num_tokens)
    cols = cols.scatter(3, keep.view(batch, 1, 1, count).expand(-1, heads, count, -1), attn)
    full = attn.new_zeros(batch, heads, num_tokens, num_tokens)
    return full.scatter(2, keep.view(batch, 1, count, 1).expand(-1, heads, -1, num_tokens), cols)
