"""Tiny models and per-kind scheme calls shared by the reliability tests; the scheme lists come from the registry
(see tests/conftest.py)."""

from __future__ import annotations

import timm
import torch

import visionpe
from visionpe.rotary.base import LinearRotary

from ..conftest import ALL_SCHEMES, LIE, ROTARY

__all__ = ["ALL_SCHEMES", "LIE", "ROTARY", "perturb_", "position_tables", "tiny_video", "tiny_vit"]


def tiny_vit(pos_embed, img_size=32, patch_size=8, **kwargs) -> visionpe.VisionPEViT:
    """One block, width 32, two heads of 16 channels; a 4 x 4 patch grid at 32 px."""
    args = dict(depth=1, embed_dim=32, num_heads=2, num_classes=3, img_size=img_size, patch_size=patch_size)
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**args, **kwargs})


def tiny_video(**kwargs) -> torch.nn.Module:
    """One block of the tiny video ViT at 32 px (``kwargs`` override or add ``timm.create_model`` arguments)."""
    return timm.create_model("visionpe_video_vit_tiny_tubelet2x16", **{"depth": 1, "img_size": 32, **kwargs})


def perturb_(module: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Move every parameter away from its init (zero tables, identity STRING bases) so that it matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen).to(param.dtype))
    return module


def position_tables(scheme, coords: torch.Tensor, num_prefix_tokens: int, grid_size, layer: int) -> list:
    """The position-dependent tensors a rotary scheme multiplies q and k with: cos/sin tables (and STRING's basis
    P), or the block rotations of LieRE/ComRoPE."""
    state = scheme.prepare(coords, num_prefix_tokens, grid_size=grid_size)
    if isinstance(scheme, LinearRotary):
        rotation = state.layer(layer)
        basis, tables = rotation.basis, rotation.without_basis()
        return [tables.cos, tables.sin, *([] if basis is None else [basis])]
    return [scheme.rotations(state.coords, layer)]
