"""CCA: concentric causal attention, positions by ring and an attention mask that flows inward.

Xing, Li, Laptev, Lu, "Mitigating Object Hallucination via Concentric Causal Attention", NeurIPS 2024,
arXiv 2410.15926 (xing0047/cca-llava).

A merged H' x W' image grid is cut into concentric rings: token (i, j) lies on ring
c(i, j) = min(i, j, H' - 1 - i, W' - 1 - j), from 0 on the border to K - 1 at the centre, with
K = ceil(min(H', W') / 2) rings. Every token of ring c gets the 1-D position s + c (s: the block's start cursor), so
the image consumes K positions instead of H' W' (12 for LLaVA-1.5's 24 x 24 grid) and the next text sits at s + K.
Inside the image the causal mask is replaced: query q sees key k iff c(k) <= c(q), so attention flows from the border
inwards and is bidirectional within a ring; everything outside the N x N visual block stays causal. The mask applies
when the prompt is encoded; decoded tokens (text after the image) use the plain causal mask.

This library's reading where the paper and its code say nothing:

- non-square grids use c(i, j) above with K = ceil(min(H', W') / 2), which is the released rule on square grids;
- a video (the paper covers images) is a run of frames: frame t of a block sits at s + t K + c(i, j), the block
  advances by T K and the mask rule inside it is "k visible to q iff position(k) <= position(q)", i.e. earlier frames
  entirely, the current frame by rings. For images that is exactly the ring rule above;
- several images per sample each get their own rings (the code assumes one image of 576 tokens);
- ids and masks are built per sample. The released ``cca_forward`` resets its list of per-sample ids inside the batch
  loop, so only the last sample's ids survive (broadcast to every sample) and only sample 0 gets the concentric mask:
  it is right only for batch size 1 or equal image offsets. That batch bug is not reproduced.

The ids are one row broadcast to (t, h, w), read by the ``single_axis`` allocation: plain 1-D RoPE in the language
model.
"""

from __future__ import annotations

import torch

from ..checks import check_instance, check_int
from .design import DesignOutput, VisualLayout, parse_layout

__all__ = [
    "concentric_levels",
    "ring_levels",
    "cca_design",
    "cca_attention_mask",
    "visual_block_mask",
    "additive_mask",
    "check_mask_dtype",
]


def concentric_levels(height: int, width: int) -> torch.Tensor:
    """(height, width) int64 ring index c(i, j) = min(i, j, height - 1 - i, width - 1 - j) of a merged grid.

    Example:
        >>> concentric_levels(4, 4).tolist()
        [[0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]]
    """
    check_int(height, "height", min=1)
    check_int(width, "width", min=1)
    i = torch.arange(height)[:, None]
    j = torch.arange(width)[None, :]
    return torch.minimum(torch.minimum(i, j), torch.minimum(height - 1 - i, width - 1 - j))


def ring_levels(layout: VisualLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) ring c(i, j) of every visual token and (G,) ring count K = ceil(min(H', W') / 2) of every block."""
    height = layout.per_token(layout.block_thw[:, 1])
    width = layout.per_token(layout.block_thw[:, 2])
    row, col = layout.row, layout.col
    level = torch.minimum(torch.minimum(row, col), torch.minimum(height - 1 - row, width - 1 - col))
    rings = (torch.minimum(layout.block_thw[:, 1], layout.block_thw[:, 2]) + 1) // 2
    return level, rings


def cca_design(layout: VisualLayout) -> DesignOutput:
    """CCA ids: token (t, i, j) of a block at its start + t K + c(i, j); the block advances by T K (module docstring).

    The design takes no options.
    """
    level, rings = ring_levels(layout)
    local = layout.frame * layout.per_token(rings) + level
    advance = layout.block_thw[:, 0] * rings
    # The centre ring (K - 1) of the last frame is the block's largest id: T K - 1.
    return DesignOutput(local=local.expand(3, -1), advance=advance, block_top=advance - 1)


def visual_block_mask(layout: VisualLayout, local: torch.Tensor) -> torch.Tensor:
    """(B, L, L) bool: query q (dim 1) may attend key k (dim 2).

    Causal (k <= q) everywhere except between two tokens of the same visual block, where k is visible to q iff
    ``local[k] <= local[q]`` (``local``: (N,) position offset of each visual token in its block, e.g. the ring
    index). Padded keys are hidden from every query, and that is the only change padding makes, as in transformers'
    causal masks (a left-padded query row therefore sees nothing).
    """
    batch_size, seq_len = layout.valid.shape
    device = layout.valid.device
    block = torch.full((batch_size * seq_len,), -1, dtype=torch.long, device=device)
    block.index_copy_(0, layout.flat, layout.block)
    block = block.view(batch_size, seq_len)
    value = torch.zeros(batch_size * seq_len, dtype=local.dtype, device=device)
    value.index_copy_(0, layout.flat, local)
    value = value.view(batch_size, seq_len)
    position = torch.arange(seq_len, device=device)
    causal = position[:, None] >= position[None, :]
    same = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    inner = value[:, None, :] <= value[:, :, None]
    allowed = torch.where(same, inner, causal)
    return allowed & layout.valid[:, None, :]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, L, L) additive float mask of ``dtype`` from a (B, L, L) bool: 0 where allowed, finfo(dtype).min elsewhere.

    finfo.min rather than -inf: a row with no visible key (a left-padded query) then softmaxes to finite values, as in
    transformers' eager masks.
    """
    out = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def check_mask_dtype(dtype: object) -> torch.dtype:
    """``dtype`` if it is a floating point torch.dtype; TypeError / ValueError naming ``dtype`` otherwise."""
    check_instance(dtype, "dtype", torch.dtype, expected="a floating point torch.dtype (e.g. torch.bfloat16)")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype}")
    return dtype


def cca_attention_mask(
    token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """CCA's attention mask for a batch, as an additive (B, 1, L, L) float mask (0 visible, finfo(dtype).min hidden).

    Causal everywhere, except inside each visual block, where key k is visible to query q iff c(k) <= c(q) (ring
    indices; for videos, position(k) <= position(q), see the module docstring). Padded keys are hidden from every
    query. Built per sample: the released code's batch bug (only sample 0 gets the concentric mask) is
    not reproduced.

    Args:
        token_type_ids: (B, L) 0 text, 1 image, 2 video.
        image_grid_thw, video_grid_thw: (num, 3) pre-merge (t, h, w), in order of appearance across the batch.
        attention_mask: (B, L) 1 for tokens, 0 for padding (left or right), or None.
        spatial_merge_size: m; a grid (t, h, w) covers t * (h/m) * (w/m) tokens.
        dtype: floating dtype of the mask (that of the attention scores).

    Example:
        >>> tt = torch.tensor([[0, 1, 1, 1, 1, 0]])  # a 2 x 2 merged image: one ring, bidirectional
        >>> visible = cca_attention_mask(tt, torch.tensor([[1, 4, 4]]))[0, 0] == 0
        >>> visible[1].int().tolist(), visible[5].int().tolist()  # an image token sees the whole image
        ([1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1])
    """
    check_mask_dtype(dtype)
    layout = parse_layout(token_type_ids, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size)
    local = cca_design(layout).local[0]
    return additive_mask(visual_block_mask(layout, local), dtype)
