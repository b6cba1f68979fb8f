"""VRoPE: rotary position embedding for video LLMs.

Liu et al., "VRoPE: Rotary Position Embedding for Video Large Language Models", EMNLP 2025,
arXiv 2502.11664 (johncaged/VRoPE).

Frame t of a block starting at s is offset by o_t = s + t * (H' + W' - 1), and rotary pair n reads
o_t + v_{n mod 4} with the diagonal variants v0 = i + j, v1 = i + (W'-1-j), v2 = (H'-1-i) + j,
v3 = (H'-1-i) + (W'-1-j). Since v3 = v1 + v2 - v0, three rows carry everything: rows (t, h, w) hold
(o + v0, o + v1, o + v2) and the allocation forms the fourth variant as h + w - t. Text sits at the same
scalar on every row; a block advances the cursor by T * (H' + W' - 1).
"""

from __future__ import annotations

import torch

from .design import DesignOutput, VisualLayout

__all__ = ["vrope_design"]


def vrope_design(layout: VisualLayout) -> DesignOutput:
    """Rows (o + v0, o + v1, o + v2) per visual token; advance T * (H' + W' - 1)."""
    height, width = layout.per_token(layout.block_thw[:, 1]), layout.per_token(layout.block_thw[:, 2])
    frame_offset = layout.frame * (height + width - 1)
    i, j = layout.row, layout.col
    local = torch.stack([frame_offset + i + j, frame_offset + i + (width - 1 - j), frame_offset + (height - 1 - i) + j])
    thw = layout.block_thw
    advance = (thw[:, 0] * (thw[:, 1] + thw[:, 2] - 1)).double()
    # Largest id: the last frame's corner (H'-1, W'-1) on row t, (T - 1)(H' + W' - 1) + H' + W' - 2 = advance - 1.
    return DesignOutput(local=local.double(), advance=advance, block_top=advance - 1)
