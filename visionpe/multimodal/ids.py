"""``get_position_ids``: multimodal position ids for a batch, for any registered scheme.

Huang et al., "Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026: the ids are
the position-design half of a scheme; :class:`~visionpe.multimodal.MultimodalRotary` is the allocation half.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import check_choice, check_float
from .design import assemble_positions, parse_layout
from .registry import get_multimodal_scheme

__all__ = ["get_position_ids", "DELTA_CONVENTIONS"]

DELTA_CONVENTIONS = ("valid", "padded")


def get_position_ids(
    scheme: str,
    token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    pad_value: float = 1,
    delta_convention: str = "valid",
    **scheme_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and decoding deltas for a batch of interleaved text, images and videos.

    Vectorised over the batch: the only Python loop runs over the two modalities.

    Args:
        scheme: a name from :func:`list_multimodal_schemes` (``mrope``, ``mrope_abs_time``, ``v2pe``...).
        token_type_ids: (B, L) 0 text, 1 image, 2 video (transformers' ``mm_token_type_ids``).
        image_grid_thw: (num_images, 3) pre-merge (t, h, w) rows, in order of appearance across the batch.
        video_grid_thw: (num_videos, 3) likewise for videos.
        attention_mask: (B, L) 1 for tokens, 0 for padding; left and right padding both work.
        spatial_merge_size: m; a grid (t, h, w) covers t * (h/m) * (w/m) tokens.
        pad_value: value written at padded slots (1, as legacy Hugging Face code; transformers 5.x uses 0).
        delta_convention: ``"valid"`` (transformers 5.x): delta = next - n_valid, decode at
            cumsum(mask) - 1 + delta; ``"padded"`` (legacy): delta = next - L, decode at cache_position + delta.
        **scheme_kwargs: the scheme's own options, e.g. ``continuation="spatial_extent"`` (M-RoPE family),
            ``delta=0.25`` (V2PE), ``second_per_grid_ts=...`` (Qwen2.5-VL time), ``spatial_reset=True``.

    Returns:
        position_ids: (3, B, L) rows (t, h, w); int64, or float64 for schemes with fractional positions
            (v2pe, videorope, hope, circle_rope, mrope_abs_time with ``fractional_time=True``, a non-integer
            ``pad_value``): fp32 would merge V2PE's 1/256 steps above 2^16 (Ge et al., V2PE, 2024), fp64 keeps them
            distinct at 1M tokens. :class:`~visionpe.multimodal.MultimodalRotary` takes their angles in fp64.
        rope_deltas: (B, 1), same dtype; the next decoding position minus the reference length above.

    Example:
        >>> tt = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]])
        >>> pos, delta = get_position_ids("mrope", tt, image_grid_thw=torch.tensor([[1, 4, 6]]))
        >>> pos[:, 0].tolist()
        [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7], [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7], [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]
        >>> delta.tolist()
        [[-3]]
    """
    entry = get_multimodal_scheme(scheme)
    check_choice(delta_convention, "delta_convention", DELTA_CONVENTIONS)
    check_float(pad_value, "pad_value", expected="finite (it becomes a rotary position)", type_expected="a number")
    entry.check_options(scheme_kwargs)
    layout = parse_layout(token_type_ids, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size)
    design = entry.design(layout, **scheme_kwargs)
    return assemble_positions(layout, design, pad_value=pad_value, delta_convention=delta_convention)
