"""Multimodal rotary tables: position ids (3, B, L) -> cos/sin, through a frequency allocation.

Huang et al., "Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026; layout as
Qwen2-VL in Hugging Face transformers ("half" layout: pair n is channels n and n + D/2).

phi_n = theta_n * sum_a mix[n, a] * p_a with theta_n = base^(-2n/D); cos = cos(cat(phi, phi)), (B, L, D),
or (B, H_kv, L, D) for head-wise allocations (MHRoPE), where head h reads sum_a mix[h, a] * p_a on every pair.
Angles are computed with autocast off, never in bf16/fp16: in fp32 for integer ids (exact below 2^24, the
transformers expression bit for bit) and in fp64 for float64 ids (fractional designs such as V2PE, whose steps of
2^-8 need fp64 above 2^16). Only the finished cos and sin are cast.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..checks import check_bool, check_float, check_instance, check_int, check_positive, check_tensor
from .allocation import Allocation, _check_mix, build_allocation
from .registry import get_multimodal_scheme

__all__ = ["MultimodalRotary", "apply_multimodal_rotary", "rotate_half"]


class MultimodalRotary(nn.Module):
    """cos/sin tables for multimodal position ids under a frequency allocation.

    Args:
        head_dim: D, the rotated channels per head (even).
        base: RoPE base theta (Qwen2-VL/2.5-VL checkpoints use 1e6, Qwen3-VL 5e6).
        allocation: an :class:`Allocation` or a name from ``ALLOCATIONS`` (``chunked``, ``interleaved``,
            ``lta``, ``hope``, ``vrope``, ``single_axis``, ``head``).
        num_kv_heads: number of KV heads, needed by head-wise allocations.
        attention_scaling: factor on cos and sin (1 for default RoPE).
        **allocation_kwargs: options of a named allocation, e.g. ``mrope_section=(16, 24, 24)``.

    Example:
        >>> rot = MultimodalRotary(8, base=10000.0, allocation="chunked", mrope_section=(2, 1, 1))
        >>> cos, sin = rot(torch.zeros(3, 2, 5, dtype=torch.long))
        >>> tuple(cos.shape), bool((cos == 1).all())
        ((2, 5, 8), True)
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        allocation: str | Allocation = "chunked",
        num_kv_heads: int | None = None,
        attention_scaling: float = 1.0,
        **allocation_kwargs: Any,
    ) -> None:
        super().__init__()
        check_int(head_dim, "head_dim", min=2, expected="a positive even int")
        if head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
        check_float(base, "base", min=1, min_open=True)
        check_positive(attention_scaling, "attention_scaling", expected="positive and finite", type_expected="a number")
        check_instance(allocation, "allocation", (str, Allocation), expected="a name or an Allocation")
        if isinstance(allocation, str):
            allocation = build_allocation(
                allocation, num_pairs=head_dim // 2, num_kv_heads=num_kv_heads, **allocation_kwargs
            )
        elif allocation_kwargs:
            raise ValueError(f"allocation_kwargs {list(allocation_kwargs)} apply to named allocations only")
        # Allocation checks its fields when it is built; again here, since its mix tensor can be changed in place.
        _check_mix(allocation.mix, "allocation.mix")
        check_bool(allocation.per_head, "allocation.per_head")
        if not allocation.per_head and allocation.mix.shape[0] != head_dim // 2:
            raise ValueError(
                f"allocation has {allocation.mix.shape[0]} pairs but head_dim={head_dim} has {head_dim // 2}"
            )
        self.head_dim, self.base, self.attention_scaling = head_dim, float(base), float(attention_scaling)
        self.per_head = allocation.per_head
        self._mix = allocation.mix.float()  # kept to rebuild the buffer in fp32 (see _apply)
        self.register_buffer("inv_freq", self._inv_freq(self.base, head_dim), persistent=False)
        self.register_buffer("mix", self._mix.clone(), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        # model.to(bfloat16) casts every floating buffer; the frequencies are rebuilt in fp32, since angles grow
        # with position (bf16 inverse frequencies would cost radians at position 1e6), as timm does for its bands
        if torch.finfo(self.inv_freq.dtype).bits < 32:
            device = self.inv_freq.device
            self.register_buffer("inv_freq", self._inv_freq(self.base, self.head_dim).to(device), persistent=False)
            self.register_buffer("mix", self._mix.to(device), persistent=False)
        return module

    @staticmethod
    def _inv_freq(base: float, head_dim: int, dtype: torch.dtype = torch.float, device=None) -> torch.Tensor:
        # Same expression as transformers' default RoPE, so that the fp32 tables match it bit for bit.
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim))

    @classmethod
    def from_scheme(cls, scheme: str, head_dim: int, *, base: float = 10000.0, **kwargs: Any) -> MultimodalRotary:
        """The rotary of a registered scheme, with its default allocation options (overridable in kwargs)."""
        entry = get_multimodal_scheme(scheme)
        options = {**entry.allocation_kwargs, **kwargs}
        return cls(head_dim, base=base, allocation=entry.allocation, **options)

    def angles(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Angles (B, L, D/2), or (B, H_kv, L, D/2) per head, from ids (3, B, L) or (B, L).

        fp64 for float64 ids (id * inv_freq with inv_freq computed in fp64: accurate at position 1e6 and exact for
        fractional steps of 2^-8 up to 2^44); fp32 for any other dtype (int64 ids are exact below 2^24).
        """
        check_tensor(position_ids, "position_ids", expected="a tensor")
        check_tensor(position_ids, "position_ids", dtype="real", expected="integer or floating point")
        if position_ids.ndim == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if position_ids.ndim != 3 or position_ids.shape[0] != 3 or 0 in position_ids.shape:
            raise ValueError(f"position_ids must be (3, B, L) or (B, L), non-empty, got {tuple(position_ids.shape)}")
        if (
            position_ids.is_floating_point()
            and not torch.compiler.is_compiling()  # no data-dependent branch in compiled or exported graphs
            and not torch.isfinite(position_ids).all()
        ):
            raise ValueError("position_ids must be finite, got NaN or inf")
        with torch.autocast(position_ids.device.type, enabled=False):
            if position_ids.dtype == torch.float64:
                # Fractional ids: positions, mix and frequencies in fp64 (V2PE's 2^-8 steps merge in fp32 above 2^16).
                pos = position_ids.permute(1, 2, 0)  # (B, L, 3)
                mix = self.mix.to(torch.float64)
                inv_freq = self._inv_freq(self.base, self.head_dim, torch.float64, position_ids.device)
            else:
                pos = position_ids.float().permute(1, 2, 0)  # (B, L, 3)
                mix, inv_freq = self.mix, self.inv_freq
            # Elementwise product and sum rather than a matmul: exact for one-hot rows, no TF32.
            mixed = (pos.unsqueeze(-2) * mix).sum(-1)  # (B, L, P or H)
            if self.per_head:
                return mixed.transpose(1, 2).unsqueeze(-1) * inv_freq
            return mixed * inv_freq

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (B, L, D) or (B, H_kv, L, D), fp32 unless ``dtype`` (a floating torch dtype) is given.

        The angles and tables are computed in fp32 (integer ids) or fp64 (float64 ids, see :meth:`angles`) whatever
        ``dtype`` is, with autocast off; only the finished cos and sin are cast (fp64 ones to fp32 when ``dtype``
        is None).
        """
        if dtype is not None:
            expected = "a floating point torch.dtype (e.g. torch.bfloat16) or None"
            check_instance(dtype, "dtype", torch.dtype, expected=expected)
            if not dtype.is_floating_point:
                raise ValueError(f"dtype must be a floating point torch.dtype or None, got {dtype}")
        phi = self.angles(position_ids)
        with torch.autocast(phi.device.type, enabled=False):
            emb = torch.cat((phi, phi), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        if dtype is None and position_ids.dtype == torch.float64:
            dtype = torch.float32  # fp64 tables of float64 ids are an internal step: the default stays fp32
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension, which must be even and non-empty."""
    check_tensor(x, "x", dtype="floating", expected="a floating point tensor")
    if x.ndim < 1 or x.shape[-1] < 2 or x.shape[-1] % 2:
        raise ValueError(
            f"x must have an even, non-zero last dimension (the two halves to rotate), got shape {tuple(x.shape)}"
        )
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_multimodal_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, H_q, L, D) and k (B, H_kv, L, D) by tables from :class:`MultimodalRotary`.

    Tables (B, L, D_r) apply to every head; per-head tables (B, H_kv, L, D_r) go to the KV heads directly
    and to query head g through KV head g // (H_q / H_kv). With D_r < D only the first D_r channels rotate.
    """
    for name, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(x, name, expected="a tensor")
        check_tensor(x, name, dtype="floating", expected="floating point")
    for name, x in (("q", q), ("k", k)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be (B, H, L, D), got {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.ndim not in (3, 4):
        raise ValueError(
            f"cos and sin must share shape (B, L, D) or (B, H_kv, L, D), got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    batch, length, rotated = cos.shape[0], cos.shape[-2], cos.shape[-1]
    for name, x in (("q", q), ("k", k)):
        if x.shape[2] != length or batch not in (1, x.shape[0]) or rotated % 2 or rotated > x.shape[-1]:
            raise ValueError(
                f"{name} {tuple(x.shape)} does not fit tables {tuple(cos.shape)}: it needs L = {length} tokens, "
                f"batch {batch} (or tables of batch 1) and at least the {rotated} rotated channels (an even count)"
            )
    if cos.ndim == 3:
        cos_q = cos_k = cos.unsqueeze(1)
        sin_q = sin_k = sin.unsqueeze(1)
    else:
        if cos.shape[1] != k.shape[1] or q.shape[1] % k.shape[1]:
            raise ValueError(f"per-head tables have {cos.shape[1]} heads; k has {k.shape[1]} and q {q.shape[1]} heads")
        group = q.shape[1] // k.shape[1]
        cos_k, sin_k = cos, sin
        cos_q, sin_q = cos.repeat_interleave(group, dim=1), sin.repeat_interleave(group, dim=1)

    def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        c, s = c.to(x.dtype), s.to(x.dtype)
        x_rot, x_pass = x[..., :rotated], x[..., rotated:]
        return torch.cat((x_rot * c + rotate_half(x_rot) * s, x_pass), dim=-1)

    return rotate(q, cos_q, sin_q), rotate(k, cos_k, sin_k)
