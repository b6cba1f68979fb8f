"""HoPE: hybrid of position embedding for length generalisation.

Li et al., "HoPE: Hybrid of Position Embedding for Length Generalization in Vision-Language Models",
arXiv 2505.20444, 2025 (NeurIPS 2025) (hrlics/HoPE).

Position design: VideoRoPE's diagonal layout with t = s + gamma * k (dynamic temporal scaling; training
draws gamma per visual span from {0.5, 0.75, 1, 1.25, 1.5}, :func:`sample_hope_scale`). Allocation: VideoRoPE's
LTA with the temporal pairs set to zero frequency for every token, text included, so a text-only sequence
is *not* plain 1-D RoPE.
"""

from __future__ import annotations

import torch

from .design import DesignOutput, VisualLayout
from .v2pe import draw_per_block, per_sample_value
from .videorope import diagonal_layout

__all__ = ["HOPE_SCALES", "hope_design", "sample_hope_scale"]

HOPE_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5)


def hope_design(layout: VisualLayout, *, temporal_scale: float | torch.Tensor = 0.75) -> DesignOutput:
    """HoPE ids; ``temporal_scale`` is gamma: a number (0.75 in the V-NIAH evaluation), a (B,) tensor (one per
    sample) or a (B, K) tensor (one per visual span, :func:`~visionpe.multimodal.v2pe.per_sample_value`)."""
    return diagonal_layout(layout, per_sample_value(layout, temporal_scale, "temporal_scale"))


def sample_hope_scale(
    batch_size: int, generator: torch.Generator | None = None, num_blocks: int | None = None
) -> torch.Tensor:
    """Gammas drawn uniformly from {0.5, 0.75, 1.0, 1.25, 1.5}, HoPE's training distribution: (batch_size,
    num_blocks), one per visual span as in the paper, or (batch_size,) when ``num_blocks`` is None."""
    return draw_per_block(HOPE_SCALES, batch_size, generator, num_blocks)
