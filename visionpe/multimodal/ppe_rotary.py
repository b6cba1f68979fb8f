"""cos/sin tables for PPE's multi-position ids (3K, B, L).

Huang, Jiang, Zheng, Hu, Han, Chen, "PPE: Positional Preservation Embedding for Token Compression in Multimodal
Large Language Models", ICLR 2026, arXiv 2510.22936. The ids come from ``get_position_ids("ppe", ...,
num_representatives=K)`` (:mod:`visionpe.multimodal.ppe`); here every M-RoPE section is cut into K sub-bands,
sub-band k reading representative k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import check_tensor
from .allocation import ppe_split_allocation
from .rotary import MultimodalRotary

__all__ = ["PPERotary"]


class PPERotary(MultimodalRotary):
    """cos/sin tables for PPE's ids (3K, B, L) under the split allocation (half layout, as Qwen).

    Args:
        head_dim: D, the rotated channels per head.
        base: RoPE base theta.
        num_representatives: K, the positions per token (the rows of the ids are 3K).
        mrope_section: the M-RoPE sections, cut into K sub-bands each (or one-pair sections when K does not
            divide them, as released).
        attention_scaling: factor on cos and sin.

    Pair n rotates by theta_n * p[row(n)] with row(n) from
    :func:`~visionpe.multimodal.allocation.ppe_split_allocation`; with K = 1 the tables are M-RoPE's. Angles
    are taken in fp32 (integer ids) or fp64 (float64 ids) with autocast off, as :class:`MultimodalRotary`'s.

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
        attention_scaling: float = 1.0,
    ) -> None:
        # the base class checks head_dim, base, attention_scaling and the sections (as M-RoPE's)
        super().__init__(
            head_dim, base=base, allocation="chunked", mrope_section=mrope_section, attention_scaling=attention_scaling
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

    def angles(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Angles (B, L, D/2) from ids (3K, B, L), or (B, L) (the same id on every row)."""
        rows = self.mix.shape[1]
        check_tensor(position_ids, "position_ids", expected="a tensor")
        check_tensor(position_ids, "position_ids", dtype="real", expected="integer or floating point")
        if position_ids.ndim == 2:
            position_ids = position_ids.unsqueeze(0).expand(rows, -1, -1)
        if position_ids.ndim != 3 or position_ids.shape[0] != rows or 0 in position_ids.shape:
            raise ValueError(
                f"position_ids must be (3K, B, L) = ({rows}, B, L) for K = {self.num_representatives}, or (B, L), "
                f"non-empty, got {tuple(position_ids.shape)}"
            )
        if position_ids.is_floating_point() and not torch.isfinite(position_ids).all():
            raise ValueError("position_ids must be finite, got NaN or inf")
        row_of_pair = self.mix.argmax(1)  # one-hot rows: a gather is the mix, exactly
        with torch.autocast(position_ids.device.type, enabled=False):
            if position_ids.dtype == torch.float64:
                pos = position_ids.index_select(0, row_of_pair).permute(1, 2, 0)  # (B, L, P)
                inv_freq = self._inv_freq(self.base, self.head_dim, torch.float64, position_ids.device)
            else:
                pos = position_ids.index_select(0, row_of_pair).float().permute(1, 2, 0)
                inv_freq = self.inv_freq
            return pos * inv_freq
