"""Flux (``FluxTransformer2DModel``): its rotary in visionpe.

Flux numbers every token with 3 ids: an index (0 for the generated image and the text; Kontext gives a reference
image 1), the row and the column of its latent patch (the text tokens: 0, 0). ``FluxPosEmbed(theta=10000,
axes_dim=axes_dims_rope)`` turns each id into an axial rotary block (16, 56, 56 channels in the released models)
with float64 frequencies; visionpe's :class:`FluxRotary` computes the same from the same ids. The released models
were trained at 1024 px: 128 latent pixels, packed 2 x 2, a 64 x 64 grid of image tokens (DyPE's reference).
"""

from __future__ import annotations

import torch
from torch import nn

from .patch import DiffusionFamily, register_family
from .rotary import DiffusionRotary

__all__ = ["FLUX", "FluxRotary"]


def _grid_of(ids: torch.Tensor) -> torch.Tensor:
    # positions per axis: the largest id + 1 (the released DyPE code's "current patches"), kept on the ids' device
    return ids.amax(0) + 1


class FluxRotary(nn.Module):
    """Flux's ``pos_embed``: ``ids`` (S, 3) in, ``(cos, sin)`` (S, sum(axes_dim)) out, by a
    :class:`DiffusionRotary` over the axes index, height, width (the index axis is never scaled).

    In a mode other than ``"none"`` the current grid is read off the ids (largest id + 1 per axis, as the released
    DyPE code reads it) and stays on their device: the mode is computed there, without the host synchronisation of
    the released code's ``.item()``, so the module traces into the model's ``torch.compile`` graph in every mode."""

    def __init__(self, axes_dim, theta: float, train_grid_size=None) -> None:
        super().__init__()
        self.rotary = DiffusionRotary(
            axes_dim,
            theta,
            ("index", "height", "width"),
            train_grid_size,
            fixed_axes=("index",),
            freqs_dtype=torch.float64,
        )

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grid = None if self.rotary.extrapolation == "none" else _grid_of(ids)
        return self.rotary.cos_sin(ids, grid)


def _build(model: nn.Module, own: nn.Module, train_grid_size) -> FluxRotary:
    return FluxRotary(tuple(own.axes_dim), float(own.theta), train_grid_size or FLUX.default_train_grid)


FLUX = register_family(
    DiffusionFamily(
        name="flux",
        class_names=("FluxTransformer2DModel",),
        attribute="pos_embed",
        build=_build,
        timestep_scale=1.0,
        axis_names=("index", "height", "width"),
        default_train_grid=(1, 64, 64),
        own_module_class="FluxPosEmbed",
    )
)
