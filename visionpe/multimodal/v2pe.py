"""V2PE: variable visual position encoding.

Ge et al., "V2PE: Improving Multimodal Long-Context Capability of Vision-Language Models with Variable
Visual Position Encoding", ICCV 2025, arXiv 2412.09616 (OpenGVLab/V2PE).

1-D ids on all three rows. Text advances by 1; visual token k = 1..N of a block after the marker at p gets
p + delta * k, and the next text sits at ceil(p + delta * N) + 1. delta = 1 is plain 1-D RoPE. Training
draws delta per sample from {1, 1/2, ..., 1/256} (:func:`sample_v2pe_delta`); evaluation fixes it (1/4).
"""

from __future__ import annotations

import torch

from .design import DesignOutput, VisualLayout

__all__ = ["V2PE_DELTAS", "v2pe_design", "sample_v2pe_delta", "per_sample_value"]

V2PE_DELTAS = tuple(1.0 / 2**k for k in range(9))


def per_sample_value(layout: VisualLayout, value: float | torch.Tensor, name: str) -> torch.Tensor:
    """(G,) float64 value per block from a number or a (B,) per-sample tensor; must be positive and finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number or a (B,) tensor, got {type(value).__name__}")
    device = layout.block_thw.device
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device)
    if tensor.ndim == 0:
        tensor = tensor.expand(layout.batch_size)
    if tensor.shape != (layout.batch_size,):
        raise ValueError(f"{name} must be a number or a ({layout.batch_size},) tensor, got {tuple(tensor.shape)}")
    if not ((tensor > 0) & torch.isfinite(tensor)).all():
        raise ValueError(f"{name} must be positive and finite, got {tensor.tolist()}")
    return tensor[layout.block_sample]


def v2pe_design(layout: VisualLayout, *, delta: float | torch.Tensor = 0.25) -> DesignOutput:
    """Visual token k of a block: (k + 1) * delta - 1 past the block's cursor; advance ceil(delta * N).

    Args:
        delta: visual position increment, a number or a (B,) tensor with one value per sample.
    """
    step = per_sample_value(layout, delta, "delta")
    numel = layout.block_thw.prod(1).double()
    local = (layout.index + 1).double() * layout.per_token(step) - 1
    # The small epsilon keeps ceil(0.1 * 30) at 3 despite binary rounding of delta.
    advance = torch.ceil(step * numel - 1e-9)
    return DesignOutput(local=local.expand(3, -1), advance=advance, integer=False)


def sample_v2pe_delta(batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch_size,) deltas drawn uniformly from {1, 1/2, ..., 1/256}, V2PE's training distribution."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    choice = torch.randint(len(V2PE_DELTAS), (batch_size,), generator=generator)
    return torch.tensor(V2PE_DELTAS, dtype=torch.float64)[choice]
