"""M-RoPE position design of Qwen2-VL and Qwen2.5-VL (absolute time).

Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any Resolution",
arXiv 2409.12191, 2024; Bai et al., "Qwen2.5-VL Technical Report", arXiv 2502.13923, 2025.

Visual token (t, i, j) of a block starting at s sits at (s + tau(t), s + i, s + j); text at (p, p, p).
Qwen2-VL: tau(t) = t. Qwen2.5-VL: tau(t) = floor(t * (tokens_per_second * second_per_grid)), multiplied in
float and truncated once at the end (casting second_per_grid to int first collapses fps-4 video to t = 0). As in
transformers, the products are taken in second_per_grid's own dtype (float32 from the processor), so that
rounding lands on the same integers (25 * (2 * fl32(0.08)) is 4.0 in float32 but 3.99999994 in float64).

After a block the text continues at (max over the block's three rows) + 1 in the original Qwen code
(``continuation="max_plus_one"``, the default) and at s + max(H', W') in transformers 5.x
(``continuation="spatial_extent"``). The two agree for images and differ for videos whose temporal extent
exceeds the spatial one, where the 5.x rule places the next text inside the video's temporal range.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import check_bool, check_choice, check_positive
from .design import DesignOutput, VisualLayout, block_max, block_max_plus_one

__all__ = [
    "CONTINUATIONS",
    "TOKENS_PER_SECOND",
    "mrope_design",
    "mrope_abs_time_design",
    "mrope_abs_time_model_defaults",
    "continue_after_blocks",
]

CONTINUATIONS = ("max_plus_one", "spatial_extent")
# temporal ids per second of the released Qwen2.5-VL checkpoints, for a model config that does not give its own
TOKENS_PER_SECOND = 2


def continue_after_blocks(layout: VisualLayout, local: torch.Tensor, continuation: str) -> torch.Tensor:
    """(G,) cursor advance per block under ``continuation`` (see the module docstring)."""
    check_choice(continuation, "continuation", CONTINUATIONS)
    if continuation == "max_plus_one":
        return block_max_plus_one(layout, local)
    return layout.block_thw[:, 1:].amax(1)


def mrope_design(layout: VisualLayout, *, continuation: str = "max_plus_one") -> DesignOutput:
    """Qwen2-VL: local (t, i, j) on rows (t, h, w); text continues per ``continuation``."""
    check_choice(continuation, "continuation", CONTINUATIONS)
    local = torch.stack([layout.frame, layout.row, layout.col])
    # A block covers its whole T x H' x W' grid, so its largest local id is max(T, H', W') - 1: no pass over the
    # tokens for the continuation or the deltas.
    top = layout.block_thw.amax(1) - 1
    advance = top + 1 if continuation == "max_plus_one" else layout.block_thw[:, 1:].amax(1)
    return DesignOutput(local=local, advance=advance, block_top=top)


def mrope_abs_time_design(
    layout: VisualLayout,
    *,
    second_per_grid_ts: torch.Tensor | list[float] | None = None,
    tokens_per_second: float = 2.0,
    fractional_time: bool = False,
    continuation: str = "max_plus_one",
) -> DesignOutput:
    """Qwen2.5-VL: temporal id floor(t * (tokens_per_second * second_per_grid_ts[v])); images use t = 0.

    Args:
        second_per_grid_ts: (num_videos,) seconds per temporal grid (temporal_patch_size / fps); required
            whenever there are videos, so that training and generation see the same timing. A tensor's
            products are computed in its dtype and a list's in float64 then the default float dtype, as
            transformers' ``get_rope_index`` does, so that the ids equal transformers' bit for bit.
        tokens_per_second: temporal ids per second; released checkpoints use 2 (the HF class default is 4),
            read it from ``vision_config.tokens_per_second``.
        fractional_time: keep t * spg * tps as a float instead of truncating it (float ids).
    """
    check_positive(tokens_per_second, "tokens_per_second", expected="positive and finite", type_expected="a number")
    check_bool(fractional_time, "fractional_time")
    num_videos = int(layout.block_is_video.sum())
    device = layout.block_thw.device
    if num_videos and second_per_grid_ts is None:
        raise ValueError(
            f"mrope_abs_time needs second_per_grid_ts (one value per video, {num_videos} here); timing must be "
            "explicit on every path, generation included"
        )
    if num_videos:
        interval = _video_intervals(second_per_grid_ts, tokens_per_second, num_videos, device)
        per_block = torch.zeros(layout.num_blocks, dtype=interval.dtype, device=device)
        is_video = layout.block_is_video
        per_block[is_video] = interval[layout.block_video[is_video]]
        # transformers: (arange(T) * interval).long(), in the interval's dtype; see _video_intervals.
        temporal = layout.frame.to(interval.dtype) * layout.per_token(per_block)
        if not fractional_time and temporal.is_floating_point():
            temporal = temporal.floor()
        temporal = temporal.double()
    else:
        temporal = torch.zeros(layout.frame.shape, dtype=torch.float64, device=device)
    local = torch.stack([temporal, layout.row.double(), layout.col.double()])
    check_choice(continuation, "continuation", CONTINUATIONS)
    top = block_max(layout, local)
    advance = top + 1 if continuation == "max_plus_one" else layout.block_thw[:, 1:].amax(1)
    return DesignOutput(local=local, advance=advance, integer=not fractional_time, block_top=top)


def mrope_abs_time_model_defaults(config: Any) -> dict[str, Any]:
    """The options :func:`mrope_abs_time_design` reads from a model's config: ``tokens_per_second`` of its
    ``vision_config`` (Qwen2.5-VL's), :data:`TOKENS_PER_SECOND` where the config has none.

    Example:
        >>> from types import SimpleNamespace
        >>> mrope_abs_time_model_defaults(SimpleNamespace(vision_config=SimpleNamespace(tokens_per_second=4)))
        {'tokens_per_second': 4.0}
        >>> mrope_abs_time_model_defaults(SimpleNamespace())
        {'tokens_per_second': 2.0}
    """
    vision_config = getattr(config, "vision_config", None)
    return {"tokens_per_second": float(getattr(vision_config, "tokens_per_second", TOKENS_PER_SECOND))}


def _video_intervals(
    second_per_grid_ts: torch.Tensor | list[float], tokens_per_second: float, num_videos: int, device: torch.device
) -> torch.Tensor:
    """(num_videos,) temporal ids per grid, ``tokens_per_second * second_per_grid_ts[v]``, as transformers has it.

    transformers (Qwen2.5-VL ``get_rope_index``) multiplies each element by the Python number
    ``tokens_per_second`` and then ``arange(T)`` by that product, all in the element's dtype, and truncates. A
    tensor therefore keeps its dtype: the processor's float32 spg = 2 / 25 gives 25 * (2 * spg) = 4.0 in float32,
    while the float64 product of the same float32 value is 3.99999994 and floors to 3 (one id low at frames 25,
    50...; spg 0.7 is one low at every 5th frame). Python numbers multiply in float64 and the product becomes the
    default float dtype when it scales ``arange(T)``, which is what the list branch does.
    """
    if isinstance(second_per_grid_ts, torch.Tensor):
        spg = second_per_grid_ts.detach().to(device).flatten()
        if spg.dtype == torch.bool or spg.is_complex():
            raise TypeError(f"second_per_grid_ts must hold real numbers, got dtype {spg.dtype}")
        interval = spg * tokens_per_second
    else:
        try:
            spg = torch.as_tensor(second_per_grid_ts, dtype=torch.float64, device=device).flatten()
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"second_per_grid_ts must be a tensor or list of {num_videos} numbers, got "
                f"{type(second_per_grid_ts).__name__}"
            ) from err
        interval = (spg * float(tokens_per_second)).to(torch.get_default_dtype())
    if spg.numel() != num_videos or (spg < 0).any() or not torch.isfinite(spg).all():
        raise ValueError(
            f"second_per_grid_ts must hold {num_videos} non-negative finite values (one per video), got {spg.tolist()}"
        )
    return interval
