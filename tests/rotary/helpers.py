"""Shared checks for rotary schemes."""

import torch


def relative_error(rotate, coords: torch.Tensor, shift: torch.Tensor, head_dim: int, num_heads: int = 2, layer=0):
    """Max |<R(p_i+t)q, R(p_j+t)k> - <R(p_i)q, R(p_j)k>| over all token pairs."""
    q = torch.randn(1, num_heads, coords.shape[0], head_dim)
    k = torch.randn(1, num_heads, coords.shape[0], head_dim)
    logits = rotate(q, coords, layer) @ rotate(k, coords, layer).transpose(-1, -2)
    shifted = rotate(q, coords + shift, layer) @ rotate(k, coords + shift, layer).transpose(-1, -2)
    return (logits - shifted).abs().max().item()
