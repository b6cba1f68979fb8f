"""cos/sin tables for PPE's multi-position ids (3K, B, L).

Huang, Jiang, Zheng, Hu, Han, Chen, "PPE: Positional Preservation Embedding for Token Compression in Multimodal
Large Language Models", ICLR 2026, arXiv 2510.22936. The ids come from ``get_position_ids("ppe", ...,
num_representatives=K)`` (:mod:`visionpe.multimodal.ppe`); here every M-RoPE section is cut into K sub-bands,
sub-band k reading representative k.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .allocation import ppe_split_allocation
from .rotary import MultimodalRotary, RopeScaling

__all__ = ["PPERotary"]


class PPERotary(MultimodalRotary):
    """cos/sin tables for PPE's ids (3K, B, L) under the split allocation (half layout, as Qwen).

    Args:
        head_dim: D, the rotated channels per head.
        base: RoPE base theta.
        num_representatives: K, the positions per token (the rows of the ids are 3K).
        mrope_section: the M-RoPE sections, cut into K sub-bands each (or one-pair sections when K does not
            divide them, as released).
        attention_scaling: factor on cos and sin; None (default) takes ``rope_scaling``'s (1 unless YaRN).
        rope_scaling: the language model's context-extension scaling (linear, dynamic NTK, YaRN...), applied to the
            frequencies as in :class:`MultimodalRotary`.

    Pair n rotates by theta_n * p[row(n)] with row(n) from
    :func:`~visionpe.multimodal.allocation.ppe_split_allocation`; with K = 1 the tables are M-RoPE's. Angles
    are taken in fp32 (integer ids) or fp64 (float64 ids) with autocast off, as :class:`MultimodalRotary`'s.
    Ids of three rows (t, h, w) stand for a token whose K representatives share its position (text, or tokens
    that were not merged, as transformers' cached decoding builds them): row a is read by every sub-band of axis
    a, so that with equal representatives (and K dividing the sections) the tables are M-RoPE's.

    Example:
        >>> rot = PPERotary(8, num_representatives=2, mrope_section=(2, 2, 0))
        >>> cos, sin = rot(torch.zeros(6, 1, 3, dtype=torch.long))
        >>> tuple(cos.shape)
        (1, 3, 8)
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        num_representatives: int = 8,
        mrope_section: Sequence[int] = (16, 24, 24),
        attention_scaling: float | None = None,
        rope_scaling: RopeScaling | Mapping[str, Any] | None = None,
    ) -> None:
        # the base class checks head_dim, base, the scalings and the sections (as M-RoPE's)
        super().__init__(
            head_dim,
            base=base,
            allocation="chunked",
            mrope_section=mrope_section,
            attention_scaling=attention_scaling,
            rope_scaling=rope_scaling,
        )
        allocation = ppe_split_allocation(head_dim // 2, mrope_section, num_representatives)
        self.num_representatives = num_representatives
        self._mix = allocation.mix.float()
        self.register_buffer("mix", self._mix.clone(), persistent=False)

    @classmethod
    def from_scheme(cls, scheme: str, head_dim: int, *, base: float = 10000.0, **kwargs) -> PPERotary:
        """``PPERotary(head_dim, base=base, **kwargs)``; ``scheme`` must be ``"ppe"``."""
        if scheme != "ppe":
            raise ValueError(f"PPERotary serves the 'ppe' scheme, got {scheme!r}; use MultimodalRotary.from_scheme")
        return cls(head_dim, base=base, **kwargs)

    def _mixed_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(B, L, P): pair n's position, row(n) of the ids; the mix is one-hot, so a gather is the mix, exactly,
        without the product over all 3K rows."""
        pos = position_ids.index_select(0, self.mix.argmax(1)).permute(1, 2, 0)
        return pos if pos.dtype == torch.float64 else pos.float()
