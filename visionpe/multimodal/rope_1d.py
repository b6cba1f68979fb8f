"""Plain 1-D RoPE over the token sequence: every token, text or visual, one position further.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", Neurocomputing 2024, arXiv 2104.09864;
used unchanged for the image tokens of LLaVA (Liu et al., "Visual Instruction Tuning", NeurIPS 2023), LLaVA-OneVision
and InternVL (up to InternVL2.5), whose language models take 1-D position ids.

A visual block with merged grid T x H' x W' starting at cursor s puts its token of raster index
k = t H' W' + i W' + j at s + k and advances the cursor by T H' W', so that the ids of a sequence are
``cumsum(attention_mask) - 1``: the ids these models' ``generate`` builds. Ids are integers, the same on the three
rows, and the ``single_axis`` allocation reads one of them on every rotary pair, which reproduces the language
model's own RoPE (the tables equal transformers' bit for bit). This is the "the model's own scheme" of the 1-D RoPE
adapter (:mod:`visionpe.integrations.hf.llava`); it equals ``v2pe`` with ``delta=1`` except that its ids stay int64.
"""

from __future__ import annotations

from .design import DesignOutput, VisualLayout

__all__ = ["rope_1d_design"]


def rope_1d_design(layout: VisualLayout) -> DesignOutput:
    """Visual token of raster index k in its block: k past the block's cursor; a block advances by its token count.

    Example:
        >>> import torch
        >>> from visionpe.multimodal import get_position_ids
        >>> types = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0]])
        >>> pos, delta = get_position_ids("rope_1d", types, torch.tensor([[1, 2, 3]]), spatial_merge_size=1)
        >>> pos[0].tolist(), delta.tolist()
        ([[0, 1, 2, 3, 4, 5, 6, 7, 8]], [[0]])
    """
    local = layout.index.expand(3, -1)
    count = layout.block_thw.prod(1)
    return DesignOutput(local=local, advance=count, block_top=count - 1)
