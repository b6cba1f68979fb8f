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
from .v2pe import per_sample_value
from .videorope import diagonal_layout

__all__ = ["HOPE_SCALES", "hope_design", "sample_hope_scale"]

HOPE_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5)


def hope_design(layout: VisualLayout, *, temporal_scale: float | torch.Tensor = 0.75) -> DesignOutput:
    """HoPE ids; ``temporal_scale`` is gamma (number or (B,) per sample), 0.75 in the V-NIAH evaluation."""
    return diagonal_layout(layout, per_sample_value(layout, temporal_scale, "temporal_scale"))


def sample_hope_scale(batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch_size,) gammas drawn uniformly from {0.5, 0.75, 1.0, 1.25, 1.5}, HoPE's training distribution."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    choice = torch.randint(len(HOPE_SCALES), (batch_size,), generator=generator)
    return torch.tensor(HOPE_SCALES, dtype=torch.float64)[choice]
