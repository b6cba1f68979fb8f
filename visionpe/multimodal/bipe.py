"""BiPE: bilevel positional encoding, for text with images and video frames.

He, Feng, Luo et al., "Two Stones Hit One Bird: Bilevel Positional Encoding for Better Length Extrapolation",
ICML 2024, arXiv 2401.16421 (zhenyuhe00/BiPE).

A sequence is cut into segments. Each token gets two indices: the *inter-segment* index (how many segments
precede its own), which drives the rotary position (BiPE-RoPE), and the *intra-segment* index (its offset inside
the segment, clipped at 1023), which selects a learned absolute embedding added to the token embedding. In the
released text models a segment is a sentence: it ends with its separator token, "." or "\\n" (Llama ids 869 and
13), so [a b . c d \\n e] has intra 0 1 2 0 1 2 0 and inter 0 0 0 1 1 1 2.

The paper has no vision-language model; this module is the library's reading of it for one:

- a segment is a text sentence (closed by a separator among ``separator_ids``) or one visual unit: an image, or
  one frame (t-slice) of a video, or one tile when tiles are frames of the grid; a visual unit closes the open
  sentence before it and is closed itself, so it never shares an inter index with text;
- the inter index is the 1-D rotary id on the three rows (:func:`bipe_design`, registered as ``"bipe"``);
- the intra index is a side output (:func:`bipe_side_index`), to feed a learned table (text) or a fixed 2-D
  sin-cos of (row, column) (visual units, whose (row, column) the side output also gives), added to the inputs.
  It must never be passed as ``position_ids``: with repeated minima it splits FlashAttention-2's packed
  sequences.

Without ``input_ids`` no separator can be seen, and every text token is a segment of its own: text gets plain
1-D ids and each visual unit one id. Decoding: the next id (``rope_deltas``) assumes the next token continues
the open sentence (the same id when the last token is not a separator); a decoder must advance the inter index
only after a separator, which ``generate``'s +1 per token does not do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import ArgumentTypeError, check_int, check_tensor, is_int
from .design import DesignOutput, VisualLayout, assemble_positions, parse_layout

__all__ = [
    "BIPE_SEPARATOR_IDS",
    "BIPE_MAX_INTRA",
    "BiPESideIndex",
    "bipe_advance_tokens",
    "bipe_design",
    "bipe_side_index",
]

BIPE_SEPARATOR_IDS = (869, 13)  # "." and "\n" in the Llama tokenizer, as in the released BiPE code
BIPE_MAX_INTRA = 1024  # rows of the released intra-segment embedding table


def _check_separators(separator_ids: Sequence[int]) -> tuple[int, ...]:
    if isinstance(separator_ids, torch.Tensor):
        if separator_ids.is_floating_point() or separator_ids.is_complex() or separator_ids.dtype == torch.bool:
            raise ArgumentTypeError(f"separator_ids must hold int token ids, got dtype {separator_ids.dtype}")
        separator_ids = separator_ids.flatten().tolist()
    if (
        not isinstance(separator_ids, (list, tuple))
        or not separator_ids
        or not all(is_int(s) and s >= 0 for s in separator_ids)
    ):
        raise ValueError(
            f"separator_ids must be a non-empty list or tuple of non-negative int token ids, got {separator_ids!r}"
        )
    return tuple(separator_ids)


def bipe_advance_tokens(options: dict[str, Any]) -> tuple[int, ...]:
    """The token ids after which :func:`bipe_design`'s text position advances, for its design ``options``
    (``separator_ids``, :data:`BIPE_SEPARATOR_IDS` by default): a decoder adds one after these tokens only.

    Example:
        >>> bipe_advance_tokens({})
        (869, 13)
        >>> bipe_advance_tokens({"separator_ids": torch.tensor([[5], [7]])})
        (5, 7)
    """
    if not isinstance(options, dict):
        raise ArgumentTypeError(f"options must be a dict of bipe's design options, got {type(options).__name__}")
    return tuple(torch.as_tensor(options.get("separator_ids", BIPE_SEPARATOR_IDS)).reshape(-1).tolist())


def _previous_valid(valid: torch.Tensor) -> torch.Tensor:
    """(B, L) position of the previous valid token of the same sample, -1 where there is none."""
    arange = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    last = torch.where(valid, arange, -1).cummax(1).values
    return torch.cat([torch.full_like(last[:, :1], -1), last[:, :-1]], 1)


def _separators(layout: VisualLayout, input_ids: torch.Tensor | None, separator_ids: Sequence[int]) -> torch.Tensor:
    """(B, L) bool: valid text tokens that close their segment (every text token without ``input_ids``)."""
    ids = _check_separators(separator_ids)
    if input_ids is None:
        return layout.is_text
    check_tensor(input_ids, "input_ids", dtype="integer", expected="a (B, L) integer tensor of token ids")
    if input_ids.shape != layout.valid.shape:
        raise ValueError(
            f"input_ids must have the shape of token_type_ids {tuple(layout.valid.shape)}, got {tuple(input_ids.shape)}"
        )
    device = layout.valid.device
    closes = torch.isin(input_ids.to(device), torch.tensor(ids, dtype=input_ids.dtype, device=device))
    return closes & layout.is_text


def bipe_design(
    layout: VisualLayout,
    *,
    input_ids: torch.Tensor | None = None,
    separator_ids: Sequence[int] = BIPE_SEPARATOR_IDS,
) -> DesignOutput:
    """BiPE's inter-segment index as the 1-D rotary id on the rows (t, h, w) (the library's reading, see the module
    docstring).

    Args:
        input_ids: (B, L) token ids, where the separators are found; None: every text token is its own segment.
        separator_ids: token ids that close a text segment (Llama's "." and "\\n", 869 and 13, as released).
    """
    closes = _separators(layout, input_ids, separator_ids)
    # A visual unit opens a new segment when the token before it is text that no separator closed.
    previous = _previous_valid(layout.valid)
    before = previous.view(-1).index_select(0, layout.flat.index_select(0, layout.block_first))
    sample = layout.block_sample
    open_text = (before >= 0) & layout.is_text[sample, before.clamp(min=0)] & ~closes[sample, before.clamp(min=0)]
    opens = layout.per_token(open_text.long())
    # One id per frame (visual unit); the block consumes one id per frame, plus the one its opening costs.
    local = opens + layout.frame
    advance = open_text.long() + layout.block_thw[:, 0]
    return DesignOutput(local=local.expand(3, -1), advance=advance, text_advance=closes.long(), block_top=advance - 1)


@dataclass(frozen=True)
class BiPESideIndex:
    """Both BiPE indices of a batch, (B, L) int64 each.

    ``inter``: the segment index (the rotary id, row 0 of ``get_position_ids("bipe", ...)``; pads hold
    ``pad_value``). ``intra``: offset inside the segment (text: inside its sentence; visual: raster index inside
    its frame), clipped at ``max_intra - 1``; 0 at pads. ``visual_row``, ``visual_col``: (row, column) of visual
    tokens inside their frame, -1 at text and pads. ``is_visual``: bool mask of visual tokens.
    """

    inter: torch.Tensor
    intra: torch.Tensor
    visual_row: torch.Tensor
    visual_col: torch.Tensor
    is_visual: torch.Tensor


def bipe_side_index(
    token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    separator_ids: Sequence[int] = BIPE_SEPARATOR_IDS,
    max_intra: int = BIPE_MAX_INTRA,
    spatial_merge_size: int = 2,
    pad_value: int = 1,
) -> BiPESideIndex:
    """BiPE's inter- and intra-segment indices (the library's reading for images and frames, see the module
    docstring). Arguments as :func:`~visionpe.multimodal.get_position_ids` and :func:`bipe_design`.

    Args:
        max_intra: rows of the intra-segment table (1024 released); larger offsets are clipped to ``max_intra - 1``.

    The intra index feeds an absolute table added to the token embedding, never ``position_ids``.

    Example:
        >>> ids = torch.tensor([[5, 6, 869, 7, 8, 13, 9]])  # a b . c d \\n e
        >>> side = bipe_side_index(torch.zeros(1, 7, dtype=torch.long), input_ids=ids)
        >>> side.intra.tolist(), side.inter.tolist()
        ([[0, 1, 2, 0, 1, 2, 0]], [[0, 0, 0, 1, 1, 1, 2]])
    """
    check_int(max_intra, "max_intra", min=1)
    check_int(pad_value, "pad_value", expected="an int (BiPE ids are integers)")
    layout = parse_layout(token_type_ids, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size)
    design = bipe_design(layout, input_ids=input_ids, separator_ids=separator_ids)
    positions, _ = assemble_positions(layout, design, pad_value=pad_value, delta_convention="valid")
    inter = positions[0]
    valid = layout.valid
    # A segment starts where the inter index changes from the previous valid token (or at the first token).
    previous = _previous_valid(valid)
    prev_inter = inter.gather(1, previous.clamp(min=0))
    starts = valid & ((previous < 0) | (inter != prev_inter))
    arange = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    rank = valid.long().cumsum(1) - 1  # rank among the sample's valid tokens (holes in the mask skipped)
    start_rank = torch.where(starts, rank, -1).cummax(1).values
    intra = (rank - start_rank).clamp(max=max_intra - 1).masked_fill(~valid, 0)
    visual_row = torch.full_like(arange, -1)
    visual_col = torch.full_like(arange, -1)
    visual_row.view(-1).index_copy_(0, layout.flat, layout.row)
    visual_col.view(-1).index_copy_(0, layout.flat, layout.col)
    is_visual = torch.zeros_like(valid)
    is_visual.view(-1)[layout.flat] = True
    return BiPESideIndex(inter=inter, intra=intra, visual_row=visual_row, visual_col=visual_col, is_visual=is_visual)
