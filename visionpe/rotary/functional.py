"""Functional core shared by the rotary schemes whose angle is linear in position.

For these schemes (RoPE-Axial, RoPE-Mixed, the RoPE part of STRING) the angle of rotary pair j is
phi_j(p) = sum_a p_a * F[a, j], with F a (possibly learned, per layer and head) frequency matrix.
Layout is interleaved: pair j is channels (2j, 2j+1), rotated as (a, b) -> (a cos - b sin, a sin + b cos).
Angles are computed in fp32 with autocast off; only cos/sin meet the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rotary_angles", "rotary_tables", "apply_rotary"]


def rotary_angles(coords: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Angles ``phi = coords @ freqs`` in fp32.

    Args:
        coords: (N, ndim) token coordinates.
        freqs: (..., ndim, P) frequencies of P rotary pairs per axis (zero where a pair ignores an axis).

    Returns:
        (..., N, P) float32 angles.

    Example:
        >>> rotary_angles(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.5]]))
        tensor([[1., 1.]])
    """
    if coords.ndim != 2 or freqs.ndim < 2 or coords.shape[1] != freqs.shape[-2]:
        raise ValueError(
            f"coords (N, ndim) and freqs (..., ndim, P) must share ndim, got {tuple(coords.shape)} "
            f"and {tuple(freqs.shape)}"
        )
    with torch.autocast(coords.device.type, enabled=False):
        # Elementwise product then sum, not a matmul: the sum over 2-3 axes stays exact in fp32.
        return (coords.float().unsqueeze(-1) * freqs.float().unsqueeze(-3)).sum(-2)


def rotary_tables(angles: torch.Tensor, num_prefix_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved cos and signed-sin tables (..., num_prefix_tokens + N, 2P) from angles (..., N, P).

    Prefix rows get angle 0 (cos 1, sin 0): the identity. The sin table carries the sign of the rotation
    (-sin on even channels, +sin on odd) so that :func:`apply_rotary` needs one swap, two products, one sum.
    """
    with torch.autocast(angles.device.type, enabled=False):
        angles = angles.float()
        if num_prefix_tokens:
            angles = F.pad(angles, (0, 0, num_prefix_tokens, 0))
        cos = angles.cos().repeat_interleave(2, dim=-1)
        sin = angles.sin()
        sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., N, head_dim) by tables from :func:`rotary_tables` (broadcastable to x).

    The result keeps x's dtype; cos/sin are cast to it first (fp32 angles, low-precision products).

    Example:
        >>> x = torch.tensor([[1.0, 0.0]])
        >>> cos, sin = rotary_tables(torch.tensor([[torch.pi / 2]]))
        >>> apply_rotary(x, cos, sin).round(decimals=6) + 0.0  # + 0.0 turns -0. into 0.
        tensor([[0., 1.]])
    """
    if x.dtype == torch.float32 and not torch.onnx.is_in_onnx_export() and not torch.compiler.is_compiling():
        # fp32 fast path: one complex product per element, forward and backward (about 1.5x the real form on
        # CPU); pairs (2j, 2j+1) are the real and imaginary parts, the table is cos + i sin. Compiled graphs take
        # the real form: inductor fuses it, has no complex kernels, and the layout checks below would break the graph.
        freqs_cis = torch.complex(cos[..., ::2].float(), sin[..., 1::2].float())
        pairs = x.unflatten(-1, (-1, 2))
        if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
            pairs = pairs.contiguous()
        return torch.view_as_real(torch.view_as_complex(pairs) * freqs_cis).flatten(-2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * sin
