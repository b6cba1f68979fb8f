"""VideoRoPE: diagonal layout (DL) with adjustable temporal spacing (ATS).

Wei et al., "VideoRoPE: What Makes for Good Video Rotary Position Embedding?", ICML 2025,
arXiv 2502.05173 (Wiselnn570/VideoRoPE).

For a block starting at s: t = s + delta * k, h = t + i - floor((H'-1)/2), w = t + j - floor((W'-1)/2), so
each frame is centred on the diagonal. The next text sits at max(t row) + 1 (the released code; the paper's
Eq. 7 writes last t + delta). Images are T = 1. The allocation (LTA) gives time the lowest frequencies.
"""

from __future__ import annotations

import torch

from .design import DesignOutput, VisualLayout
from .v2pe import per_sample_value

__all__ = ["videorope_design", "diagonal_layout"]


def diagonal_layout(layout: VisualLayout, temporal_step: torch.Tensor) -> DesignOutput:
    """DL ids with a per-block temporal step (G,); shared by VideoRoPE (delta) and HoPE (gamma)."""
    height, width = layout.per_token(layout.block_thw[:, 1]), layout.per_token(layout.block_thw[:, 2])
    temporal = layout.frame.double() * layout.per_token(temporal_step)
    local = torch.stack(
        [temporal, temporal + (layout.row - (height - 1) // 2), temporal + (layout.col - (width - 1) // 2)]
    )
    last_frame = (layout.block_thw[:, 0] - 1).double() * temporal_step  # the t row's largest id, as computed above
    advance = last_frame + 1
    return DesignOutput(local=local, advance=advance, delta_rows=(0,), integer=False, block_top=last_frame)


def videorope_design(layout: VisualLayout, *, delta: float | torch.Tensor = 2.0) -> DesignOutput:
    """VideoRoPE ids; ``delta`` is the temporal spacing, 2 in the paper: a number, a (B,) tensor (one per
    sample) or a (B, K) tensor (one per visual block, :func:`~visionpe.multimodal.v2pe.per_sample_value`)."""
    return diagonal_layout(layout, per_sample_value(layout, delta, "delta"))
