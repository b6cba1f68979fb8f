"""The per-forward position context a model builds from its schemes for one grid, shared by the single-grid and
the mixed-resolution paths (:mod:`visionpe.models.vit`, :mod:`visionpe.models.naflex`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..attention import PositionContext
from ..interfaces.bias import SchemeBias

__all__ = ["build_position_context"]


def build_position_context(
    schemes: Iterable[nn.Module],
    num_prefix_tokens: int,
    grid_size: tuple[int, ...],
    device: torch.device,
    patch_depth: torch.Tensor | None = None,
) -> PositionContext:
    """The :class:`~visionpe.attention.PositionContext` of ``schemes`` (a model's position schemes, in order) for
    ``grid_size``: each rotary scheme's state, then each bias scheme's (scheme, state); absolute schemes have none.
    ``patch_depth`` (B, N) goes to the schemes that list it among their ``extra_inputs``."""
    ctx = PositionContext()
    schemes = list(schemes)
    for scheme in (m for m in schemes if m.kind == "rotary"):
        inputs = {"patch_depth": patch_depth} if "patch_depth" in scheme.extra_inputs else {}
        coords = scheme.model_coords(grid_size, device, **inputs)
        ctx.rotary.append(scheme.prepare(coords, num_prefix_tokens, grid_size=grid_size))
    for scheme in (m for m in schemes if m.kind == "bias"):
        ctx.bias.append(SchemeBias(scheme, scheme.prepare(scheme.check_grid(grid_size), num_prefix_tokens, device)))
    return ctx
