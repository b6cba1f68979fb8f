"""V2PE: variable visual position encoding.

Ge et al., "V2PE: Improving Multimodal Long-Context Capability of Vision-Language Models with Variable
Visual Position Encoding", ICCV 2025, arXiv 2412.09616 (OpenGVLab/V2PE).

1-D ids on all three rows. Text advances by 1; visual token k = 1..N of a block after the marker at p gets
p + delta * k, and the next text sits at ceil(p + delta * N) + 1. delta = 1 is plain 1-D RoPE. Training
draws delta per image, as in the paper, from {1, 1/2, ..., 1/256} (:func:`sample_v2pe_delta` with
``num_blocks``); evaluation fixes it (1/4).
"""

from __future__ import annotations

import torch

from ..checks import check_instance, check_int
from .design import DesignOutput, VisualLayout

__all__ = ["V2PE_DELTAS", "v2pe_design", "sample_v2pe_delta", "per_sample_value", "draw_per_block"]

V2PE_DELTAS = tuple(1.0 / 2**k for k in range(9))


def per_sample_value(layout: VisualLayout, value: float | torch.Tensor, name: str) -> torch.Tensor:
    """(G,) float64 value per visual block from a number, a (B,) tensor (one value per sample) or a (B, K) tensor
    (one per visual block: column k for the sample's k-th block in order of appearance, images and videos
    together; K at least the most blocks in one sample, later columns unused). Used values must be positive and
    finite."""
    check_instance(value, name, (int, float, torch.Tensor), expected="a number, a (B,) or a (B, K) tensor")
    device = layout.block_thw.device
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device)
    if tensor.ndim == 0:
        tensor = tensor.expand(layout.batch_size)
    if tensor.ndim == 2 and tensor.shape[0] == layout.batch_size:
        ordinal = layout.block_ordinal()
        most = int(ordinal.max()) + 1 if ordinal.numel() else 0
        if tensor.shape[1] < most:
            raise ValueError(
                f"{name} as a (B, K) tensor needs a column per visual block: a sample here has {most} blocks, "
                f"got K={tensor.shape[1]}"
            )
        used = tensor[layout.block_sample, ordinal]
    elif tensor.shape == (layout.batch_size,):
        used = tensor[layout.block_sample]
    else:
        raise ValueError(
            f"{name} must be a number, a ({layout.batch_size},) tensor or a ({layout.batch_size}, K) tensor, "
            f"got {tuple(tensor.shape)}"
        )
    if not ((used > 0) & torch.isfinite(used)).all():
        raise ValueError(f"{name} must be positive and finite, got {tensor.tolist()}")
    return used


def draw_per_block(
    values: tuple[float, ...], batch_size: int, generator: torch.Generator | None, num_blocks: int | None
) -> torch.Tensor:
    """Uniform draws from ``values``: (batch_size,) per sample, or (batch_size, num_blocks) per visual block.

    The per-block draw is made as (num_blocks, batch_size) and transposed, so its first column (the first block of
    every sample) is the per-sample draw of the same generator state."""
    check_int(batch_size, "batch_size", min=1)
    if num_blocks is not None:
        check_int(num_blocks, "num_blocks", min=1, expected="a positive int or None")
    rows = 1 if num_blocks is None else num_blocks
    choice = torch.randint(len(values), (rows, batch_size), generator=generator).T
    draws = torch.tensor(values, dtype=torch.float64)[choice]
    return draws[:, 0] if num_blocks is None else draws


def v2pe_design(layout: VisualLayout, *, delta: float | torch.Tensor = 0.25) -> DesignOutput:
    """Visual token k of a block: (k + 1) * delta - 1 past the block's cursor; advance ceil(delta * N).

    Args:
        delta: visual position increment: a number, a (B,) tensor (one per sample) or a (B, K) tensor (one per
            visual block, :func:`per_sample_value`).
    """
    step = per_sample_value(layout, delta, "delta")
    numel = layout.block_thw.prod(1).double()
    local = (layout.index + 1).double() * layout.per_token(step) - 1
    # The small epsilon keeps ceil(0.1 * 30) at 3 despite binary rounding of delta.
    advance = torch.ceil(step * numel - 1e-9)
    # The last token's id, computed as the tokens' are (the ids increase with the index).
    top = numel * step - 1
    return DesignOutput(local=local.expand(3, -1), advance=advance, integer=False, block_top=top)


def sample_v2pe_delta(
    batch_size: int, generator: torch.Generator | None = None, num_blocks: int | None = None
) -> torch.Tensor:
    """Deltas drawn uniformly from {1, 1/2, ..., 1/256}, V2PE's training distribution: (batch_size, num_blocks),
    one per image as in the paper, or (batch_size,) one per sample when ``num_blocks`` is None."""
    return draw_per_block(V2PE_DELTAS, batch_size, generator, num_blocks)
