"""Circle-RoPE: cone-like decoupled rotary positions for images.

Wang et al., "Circle-RoPE: Cone-like Decoupled Rotary Positional Embedding for Large Vision-Language
Models", arXiv 2505.16416, 2025 (lose4578/CircleRoPE).

Image token (i, j) is mapped to a circle of radius R in the plane orthogonal to (1, 1, 1), at angle
theta = alpha * theta_SA + (1 - alpha) * theta_GA (theta_SA: its normalised polar angle around the image
centre; theta_GA: 2 pi k / (H'W') for flat index k), then shifted by the block start s (and by
(image index) * shift along (1, 1, 1)). Text lies on the (1, 1, 1) axis, so every text token is equidistant
from all tokens of an image (per-token distance 0). The next text continues at max over rows + 1.

AGE (alternating geometry encoding, the paper's ``strategy_4`` and the released configuration): ``age=True`` gives
even decoder layers the Circle-RoPE ids and odd layers the M-RoPE ids of Qwen2-VL (:func:`mrope_design`), each a
complete set with its own text continuation after the images. ``layer=`` picks the decoder layer; the Hugging Face
adapter runs every layer with its own ids. Without ``age`` every layer has the Circle-RoPE ids.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..checks import check_bool, check_float, check_int, check_positive
from .design import DesignOutput, VisualLayout, block_max
from .mrope import mrope_design

__all__ = ["circle_rope_design", "circle_rope_layer_of"]


def circle_rope_design(
    layout: VisualLayout,
    *,
    alpha: float = 0.5,
    radius: float | str = 10.0,
    image_shift: float = 1.0,
    age: bool = False,
    layer: int = 0,
) -> DesignOutput:
    """Circle-RoPE ids for images (rows t, h, w); videos raise ValueError (the paper defines images only).

    Args:
        alpha: mix of the spatial-angle and grid-angle terms, in [0, 1] (0.5 released).
        radius: circle radius R (10 released) or ``"auto"`` for max |centred coordinate| of each image.
        image_shift: the k-th image of a sample (k from 0) is shifted by k * image_shift on every row. The
            default 1 is the paper's per-image shift; 0 matches the released code, which places every image after
            the first as the first one (on its circle around the block start, with no extra shift).
        age: alternate Circle-RoPE ids (even layers) and M-RoPE ids (odd layers) across decoder layers, the released
            configuration (``strategy_4``); False (default): Circle-RoPE ids on every layer.
        layer: the decoder layer (from 0) whose ids to build; it matters only with ``age``.
    """
    check_float(alpha, "alpha", min=0, max=1)
    if radius != "auto":
        check_positive(radius, "radius", expected="a positive finite number or 'auto'")
    check_float(image_shift, "image_shift", expected="finite", type_expected="a number")
    check_bool(age, "age")
    check_int(layer, "layer", min=0)
    if layout.block_is_video.any():
        g = int(layout.block_is_video.nonzero()[0])
        raise ValueError(
            f"circle_rope is defined for images only; video_grid_thw[{int(layout.block_video[g])}] appears in "
            f"sample {int(layout.block_sample[g])}"
        )
    if age and layer % 2:
        return mrope_design(layout)
    height, width = layout.per_token(layout.block_thw[:, 1]).double(), layout.per_token(layout.block_thw[:, 2]).double()
    x = layout.col.double() - (width - 1) / 2
    y = layout.row.double() - (height - 1) / 2
    polar = torch.atan2(y, x)
    num_blocks = layout.num_blocks
    lo = torch.zeros(num_blocks, dtype=torch.float64, device=x.device)
    lo = lo.scatter_reduce(0, layout.block, polar, reduce="amin", include_self=False)
    hi = torch.zeros_like(lo).scatter_reduce(0, layout.block, polar, reduce="amax", include_self=False)
    span = layout.per_token(hi - lo)
    spatial = torch.where(span > 0, (polar - layout.per_token(lo)) / span.clamp(min=1e-12), torch.zeros_like(polar))
    angle = alpha * spatial * 2 * math.pi + (1 - alpha) * 2 * math.pi * layout.index / (height * width)
    if radius == "auto":
        size = torch.maximum(width - 1, height - 1) / 2
    else:
        size = torch.full_like(x, float(radius))
    px, py = size * angle.cos(), size * angle.sin()
    # Orthonormal basis of the plane orthogonal to n = (1, 1, 1)/sqrt(3), components ordered (w, h, t).
    u = torch.tensor([-1.0, 1.0, 0.0], dtype=torch.float64, device=x.device) / math.sqrt(2)
    v = torch.tensor([-1.0, -1.0, 2.0], dtype=torch.float64, device=x.device) / math.sqrt(6)
    point = px[:, None] * u + py[:, None] * v  # (N, 3) as (w, h, t)
    shift = layout.per_token(layout.block_ordinal()).double() * float(image_shift)
    local = point.flip(1).T + shift  # rows (t, h, w)
    top = block_max(layout, local)
    return DesignOutput(local=local, advance=top + 1, integer=False, block_top=top)


def circle_rope_layer_of(layer: int, options: dict[str, Any]) -> int:
    """The first layer whose ids decoder layer ``layer`` shares: ``layer % 2`` with ``age=True``, else 0."""
    check_int(layer, "layer", min=0)
    return layer % 2 if options.get("age", False) else 0
