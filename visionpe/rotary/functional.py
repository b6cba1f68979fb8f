"""Functional core shared by the rotary schemes whose angle is linear in position.

For these schemes (RoPE-Axial, RoPE-Mixed, the RoPE part of STRING) the angle of rotary pair j is
phi_j(p) = sum_a p_a * F[a, j], with F a (possibly learned, per layer and head) frequency matrix.
Layout is interleaved: pair j is channels (2j, 2j+1), rotated as (a, b) -> (a cos - b sin, a sin + b cos).
Angles are computed in fp32 with autocast off; only cos/sin meet the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import check_int

__all__ = ["rotary_angles", "rotary_tables", "apply_rotary", "rotate_qkv_pairs_"]


def rotary_angles(coords: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Angles ``phi = coords @ freqs`` in fp32.

    Args:
        coords: (N, ndim) token coordinates, or (..., N, ndim) with leading dims that broadcast against those of
            ``freqs`` (per-sample positions: (B, 1, N, ndim) with (num_heads, ndim, P) frequencies).
        freqs: (..., ndim, P) frequencies of P rotary pairs per axis (zero where a pair ignores an axis).

    Returns:
        (..., N, P) float32 angles.

    Example:
        >>> rotary_angles(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.5]]))
        tensor([[1., 1.]])
    """
    if coords.ndim < 2 or freqs.ndim < 2 or coords.shape[-1] != freqs.shape[-2]:
        raise ValueError(
            f"coords (..., N, ndim) and freqs (..., ndim, P) must share ndim, got {tuple(coords.shape)} "
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
        freqs_cis = _complex_table(cos, sin)
        pairs = x.unflatten(-1, (-1, 2))
        if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
            pairs = pairs.contiguous()
        return torch.view_as_real(torch.view_as_complex(pairs) * freqs_cis).flatten(-2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * sin


def rotate_qkv_pairs_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """:func:`apply_rotary` on q and k of a fused fp32 q/k/v projection output, in place; v unchanged.

    One complex product per pair, written back into ``qkv``, so that attention cuts q, k and v from one buffer
    as timm's Attention does and keeps no rotated copy of q and k for the backward. The backward needs only the
    rotated pairs y = x f: dL/df = sum dL/dy conj(x) = sum dL/dy conj(y) / conj(f). Two conditions follow:

    - The tables must be rotations (|f| = 1 per pair: cos and sin of one angle, as :func:`rotary_tables` builds
      them), or at most rotations times a common non-zero scale (YaRN's multiplier): the backward divides by
      conj(f), so a zero factor gives inf/NaN gradients and an ill-conditioned one loses precision.
    - The incoming gradient buffer is reused: dL/dx = dL/dy conj(f) is written over the incoming gradient of
      ``qkv``, in place. That is right when the only use of the returned tensor is to be cut into q, k and v
      (as in :class:`~visionpe.PosAttention`); a caller that keeps that gradient for another use (or
      ``gradcheck`` with this as the last op, which reports "Backward is not reentrant") sees it overwritten.

    Args:
        qkv: contiguous float32 (B * T, 3 * num_heads * head_dim) or (B, T, 3 * num_heads * head_dim): q, k and
            v of each token side by side. Pass the projection's own output (``F.linear`` of flattened tokens),
            not a view of it, so that autograd records the change on the tensor itself.
        cos, sin: tables (num_heads | 1, T, head_dim) from :func:`rotary_tables`, one row per token of an image
            (prefix rows included: they are the identity), shared by the images; or (B, num_heads | 1, T, head_dim),
            each image's own (patch dropout's kept tokens, STRING's RGB-D positions), with qkv holding B * T rows.
        num_heads: heads of the projection.

    Returns:
        ``qkv`` itself.
    """
    if qkv.dtype != torch.float32:
        raise ValueError(f"qkv must be float32 (the complex product), got {qkv.dtype}")
    head_dim = check_fused_qkv(qkv, num_heads, pairs=True)
    rows = qkv.numel() // qkv.shape[-1]
    if (
        cos.ndim not in (3, 4)
        or cos.shape != sin.shape
        or cos.shape[-3] not in (1, num_heads)
        or cos.shape[-1] != head_dim
        or (rows % cos.shape[-2] if cos.ndim == 3 else rows != cos.shape[0] * cos.shape[-2])
    ):
        raise ValueError(
            f"cos and sin must have shape (num_heads | 1, T, head_dim={head_dim}) with T dividing qkv's rows, or "
            f"(B, num_heads | 1, T, head_dim) with B * T rows; qkv has {tuple(qkv.shape[:-1])}, got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    freqs = _complex_table(cos, sin)  # ([B,] num_heads | 1, T, head_dim / 2)
    return _QKVPairRotation.apply(qkv, freqs, num_heads)


def _complex_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos + i sin per pair, fp32, from the interleaved tables of :func:`rotary_tables`."""
    return torch.complex(cos[..., ::2].float(), sin[..., 1::2].float())


def check_fused_qkv(qkv: torch.Tensor, num_heads: int, pairs: bool = False) -> int:
    """head_dim of a contiguous floating-point fused projection output (..., 3 * num_heads * head_dim) (even
    when ``pairs``); ValueError naming what does not fit otherwise."""
    check_int(num_heads, "num_heads", min=1)
    unit = 3 * num_heads * (2 if pairs else 1)
    if qkv.ndim < 2 or qkv.shape[-1] % unit or not qkv.is_floating_point() or not qkv.is_contiguous():
        raise ValueError(
            f"qkv must be a contiguous floating-point (..., 3 * num_heads * head_dim) tensor with "
            f"num_heads={num_heads}{' and an even head_dim' if pairs else ''}, got shape {tuple(qkv.shape)}, "
            f"dtype {qkv.dtype}, strides {qkv.stride()}"
        )
    return qkv.shape[-1] // (3 * num_heads)


def _fused_qk(qkv: torch.Tensor, num_heads: int, tokens: int) -> torch.Tensor:
    """(B, tokens, 2, heads, head_dim) view of q and k in a contiguous fused projection output whose last dim is
    (3, heads, head_dim) and whose other dims hold B images of ``tokens`` tokens each."""
    return qkv.view(-1, tokens, 3, num_heads, qkv.shape[-1] // (3 * num_heads))[:, :, :2]


def _qk_pairs(qkv: torch.Tensor, num_heads: int, tokens: int) -> torch.Tensor:
    """Complex (B, T, 2, heads, head_dim / 2) view of the q and k pairs of a contiguous fused projection output."""
    return torch.view_as_complex(_fused_qk(qkv, num_heads, tokens).unflatten(-1, (-1, 2)))


def _pair_factor(freqs: torch.Tensor) -> torch.Tensor:
    """Complex ``freqs`` ([B,] num_heads | 1, T, head_dim / 2) laid out against :func:`_qk_pairs`'s
    (B, T, 2, heads, head_dim / 2): ([B,] T, 1, num_heads | 1, head_dim / 2)."""
    return freqs.transpose(-3, -2).unsqueeze(-3)


class _QKVPairRotation(torch.autograd.Function):
    """:func:`rotate_qkv_pairs_`: (num_heads | 1, T, head_dim / 2) complex ``freqs`` broadcast over images, or
    (B, num_heads | 1, T, head_dim / 2), one table per image; broadcast over q and k."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, freqs: torch.Tensor, num_heads: int) -> torch.Tensor:
        _qk_pairs(qkv, num_heads, freqs.shape[-2]).mul_(_pair_factor(freqs))
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(qkv, freqs)
        ctx.num_heads = num_heads
        return qkv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qkv, freqs = ctx.saved_tensors
        grad = grad.contiguous()  # the incoming buffer itself when it is dense (it is rewritten in place)
        grad_pairs = _qk_pairs(grad, ctx.num_heads, freqs.shape[-2])
        factor = _pair_factor(freqs)  # ([B,] T, 1, num_heads | 1, head_dim / 2)
        grad_qkv = grad_freqs = None
        if ctx.needs_input_grad[1]:
            rotated = _qk_pairs(qkv, ctx.num_heads, freqs.shape[-2])
            # over q and k, then the images when they share the table: ([B,] T, heads, head_dim / 2); the outer
            # reduction first (one complex reduction over dims (0, 2) runs about 40x slower)
            total = grad_pairs * rotated.conj()
            total = total.sum(0).sum(1) if freqs.ndim == 3 else total.sum(2)
            if freqs.shape[-3] == 1:  # shared by the heads
                total = total.sum(-2, keepdim=True)
            grad_freqs = (total / factor.squeeze(-3).conj()).transpose(-3, -2)
        if ctx.needs_input_grad[0]:
            grad_pairs.mul_(factor.conj())
            grad_qkv = grad
        return grad_qkv, grad_freqs, None
