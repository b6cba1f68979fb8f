"""PyPE: pyramid-descent visual position encoding, concentric positions that merge towards the centre with depth.

Chen et al., "Advancing General Multimodal Capability of Vision-language Models with Pyramid-descent Visual Position
Encoding", arXiv 2501.10967, 2025 (SakuraTroyChen/PyPE).

PyPE starts from CCA's rings (:mod:`visionpe.multimodal.cca`): token (i, j) of a merged H' x W' grid lies on ring
c(i, j) = min(i, j, H' - 1 - i, W' - 1 - j). Decoder layer l (from 0) uses K(l) levels: the periphery sits at the
block start s, rings beyond K(l) - 1 are merged into the centre, s + min(c(i, j), K(l) - 1), and the text after the
block continues at s + K(l). K drops by one every ``interval`` layers,

    K(l) = max(K(0) - floor(l / interval), 1),   K(0) = ceil(min(H', W') / 2),

so layer 0 is CCA exactly (ids and mask) and from layer (K(0) - 1) * interval on all visual tokens share position s
and see each other. The attention mask inside a block is CCA's with layer l's levels: key k visible to query q iff
level(k) <= level(q). The released code writes K(l) = floor(H'/2) + 1 - min(floor(l / interval) + 1, floor(H'/2))
for square grids, the same schedule for even sizes; this library takes K(0) = ceil(min(H', W') / 2) for every grid
(its reading: odd and non-square grids then start from CCA too). Videos, several images per sample and per-sample
batches follow CCA's conventions (frame t of a block at s + t K(l) + level).

The text ids differ per layer, so one ``position_ids`` tensor cannot hold PyPE: :func:`pype_design` gives one
layer's ids (``layer=``) and the Hugging Face adapter runs every decoder layer with its own. The interval has no
default: the paper names models by it (``pype{k}x``) and the released checkpoint's value is not stated. Layer 0's
ids do not depend on it, so it may be left out there (that is what ``get_position_ids("pype", ...)`` gives: CCA's
ids); every other layer needs it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import check_int
from .cca import additive_mask, check_mask_dtype, ring_levels, visual_block_mask
from .design import DesignOutput, VisualLayout, parse_layout

__all__ = ["pype_design", "pype_num_levels", "pype_attention_mask", "pype_layer_of"]


def _check_layer(layer: Any, interval: Any) -> None:
    check_int(layer, "layer", min=0)
    if interval is not None:
        check_int(interval, "interval", min=1, expected="a positive int (decoder layers per level dropped)")
    elif layer > 0:
        raise ValueError(
            f"pype needs interval= (decoder layers per level dropped; no default, the released checkpoint's is not "
            f"stated) to place layer {layer}; only layer 0 does not depend on it"
        )


def pype_num_levels(height: int, width: int, layer: int, interval: int | None = None) -> int:
    """K(l) = max(ceil(min(height, width) / 2) - floor(layer / interval), 1): the levels of a merged grid at a layer.

    Example:
        >>> tuple(pype_num_levels(24, 24, layer, interval=2) for layer in (0, 1, 2, 21, 22, 30))
        (12, 12, 11, 2, 1, 1)
    """
    check_int(height, "height", min=1)
    check_int(width, "width", min=1)
    _check_layer(layer, interval)
    top = (min(height, width) + 1) // 2
    return top if layer == 0 else max(top - layer // interval, 1)


def pype_design(layout: VisualLayout, *, interval: int | None = None, layer: int = 0) -> DesignOutput:
    """PyPE ids of decoder layer ``layer``: token (t, i, j) at s + t K(l) + min(c(i, j), K(l) - 1), advance T K(l).

    Args:
        interval: decoder layers per level dropped (k of ``pype{k}x``); required for ``layer`` > 0.
        layer: the decoder layer (from 0) whose ids to build; layer 0 gives CCA's ids.
    """
    _check_layer(layer, interval)
    level, rings = ring_levels(layout)
    if layer > 0:
        rings = (rings - layer // interval).clamp(min=1)
    per_token = layout.per_token(rings)
    local = layout.frame * per_token + torch.minimum(level, per_token - 1)
    advance = layout.block_thw[:, 0] * rings
    # K(l) <= K(0): the centre reaches level K(l) - 1, so the last frame's centre is the block's largest id.
    return DesignOutput(local=local.expand(3, -1), advance=advance, block_top=advance - 1)


def pype_layer_of(layer: int, options: dict[str, Any]) -> int:
    """The first layer whose ids decoder layer ``layer`` shares: floor(layer / interval) * interval.

    ``options`` are the design options given to the model; ``interval`` is required (ValueError naming it).
    """
    interval = options.get("interval")
    if interval is None:
        raise ValueError(
            "pype needs interval= (decoder layers per level dropped): it has no default, the released checkpoint's "
            "is not stated; the paper's models are pype{k}x with interval k"
        )
    _check_layer(layer, interval)
    return layer // interval * interval


def pype_attention_mask(
    token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    layer: int = 0,
    interval: int | None = None,
    spatial_merge_size: int = 2,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """PyPE's attention mask of decoder layer ``layer``, as an additive (B, 1, L, L) float mask.

    As :func:`~visionpe.multimodal.cca.cca_attention_mask` with layer ``layer``'s levels min(c, K(l) - 1): causal
    everywhere except inside each visual block, where key k is visible to query q iff level(k) <= level(q) (all
    visual tokens of a block see each other once K(l) = 1). Padded keys are hidden; built per sample.

    Args:
        token_type_ids, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size: as for
            :func:`~visionpe.multimodal.get_position_ids`.
        layer: decoder layer (from 0); layer 0 gives CCA's mask.
        interval: decoder layers per level dropped; required for ``layer`` > 0.
        dtype: floating dtype of the mask.
    """
    check_mask_dtype(dtype)
    _check_layer(layer, interval)
    layout = parse_layout(token_type_ids, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size)
    local = pype_design(layout, interval=interval, layer=layer).local[0]
    return additive_mask(visual_block_mask(layout, local), dtype)
