"""Interleaved MRoPE (Qwen3-VL, MRoPE-I) position design, with the optional spatial reset.

Huang et al., "Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026
(arXiv 2510.23095); the Qwen3-VL model in huggingface/transformers.

Without reset the ids are Qwen2-VL's (:func:`~visionpe.multimodal.mrope.mrope_design`); what changes is the
allocation (h on pairs 1, 4, 7, ..., w on 2, 5, 8, ..., see :mod:`visionpe.multimodal.allocation`).
With ``spatial_reset=True``: t = s + stride * k while h = i and w = j stay local, and the following text
starts at s + max((T-1) * stride, H'-1, W'-1) + 1.
"""

from __future__ import annotations

import torch

from ..checks import check_bool, check_positive
from .design import DesignOutput, VisualLayout, block_max_plus_one
from .mrope import mrope_design

__all__ = ["mrope_interleaved_design"]


def mrope_interleaved_design(
    layout: VisualLayout,
    *,
    spatial_reset: bool = False,
    temporal_stride: float = 1,
    continuation: str = "max_plus_one",
) -> DesignOutput:
    """MRoPE-I ids; ``spatial_reset`` makes h and w local to each block (``continuation`` applies without it)."""
    check_bool(spatial_reset, "spatial_reset")
    check_positive(temporal_stride, "temporal_stride", expected="positive and finite", type_expected="a number")
    if not spatial_reset:
        if temporal_stride != 1:
            raise ValueError(f"temporal_stride applies with spatial_reset=True only, got {temporal_stride}")
        return mrope_design(layout, continuation=continuation)
    if continuation != "max_plus_one":
        raise ValueError(f"spatial_reset=True fixes the continuation to 'max_plus_one', got {continuation!r}")
    local = torch.stack([layout.frame * float(temporal_stride), layout.row.double(), layout.col.double()])
    return DesignOutput(
        local=local,
        advance=block_max_plus_one(layout, local),
        anchored=(True, False, False),
        integer=float(temporal_stride).is_integer(),
    )
