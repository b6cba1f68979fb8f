"""A tubelet video ViT (ViViT-style spatio-temporal tokens) with pluggable 2D/3D position encodings.

Clips ``(B, C, T, H, W)`` are cut into ``tubelet_size x patch x patch`` tubelets by a Conv3d; tokens are row-major
over the ``(T', H', W')`` grid and get 3D ``(t, y, x)`` coordinates, so 3D schemes (``rope_axial``,
``rope_mixed`` with ``ndim=3``, ``none``) apply unchanged. The grid is read from every input, so longer clips
(more frames) and other frame sizes run without resizing anything: rotary tables are recomputed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .vit import VisionPEViT

__all__ = ["TubeletEmbed", "VideoPEViT"]


class TubeletEmbed(nn.Module):
    """Conv3d tubelet embedding: (B, C, T, H, W) -> (B, T', H', W', D) with T' = T / tubelet_size."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        num_frames: int = 16,
        tubelet_size: int = 2,
        bias: bool = True,
        **_: Any,  # timm passes options for 2D patch embeds (dynamic_img_pad, output_fmt, strict_img_size)
    ) -> None:
        super().__init__()
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.patch_size = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
        if num_frames % tubelet_size:
            raise ValueError(f"num_frames must be divisible by tubelet_size={tubelet_size}, got {num_frames}")
        self.num_frames, self.tubelet_size = num_frames, tubelet_size
        self.dynamic_img_pad = False
        spatial = tuple(s // p for s, p in zip(self.img_size, self.patch_size, strict=True))
        self.grid_size = (num_frames // tubelet_size, *spatial)
        self.num_patches = self.grid_size[0] * self.grid_size[1] * self.grid_size[2]
        self.proj = nn.Conv3d(
            in_chans,
            embed_dim,
            kernel_size=(tubelet_size, *self.patch_size),
            stride=(tubelet_size, *self.patch_size),
            bias=bias,
        )

    def feat_ratio(self, as_scalar: bool = True):
        return max(self.patch_size) if as_scalar else self.patch_size

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        return img_size[0] // self.patch_size[0], img_size[1] // self.patch_size[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).permute(0, 2, 3, 4, 1)


class VideoPEViT(VisionPEViT):
    """Video classifier: ``(B, C, T, H, W)`` clips -> ``(B, num_classes)`` logits.

    Args:
        num_frames: frames of the training clip (sets the nominal temporal grid, e.g. for learned-free schemes
            that take a training grid); any multiple of ``tubelet_size`` runs at inference.
        tubelet_size: frames per tubelet.
        pos_embed, pos_embed_kwargs, **kwargs: as :class:`VisionPEViT`; schemes must support 3D grids.
    """

    def __init__(self, num_frames: int = 16, tubelet_size: int = 2, **kwargs: Any) -> None:
        def embed_layer(**embed_kwargs):
            return TubeletEmbed(num_frames=num_frames, tubelet_size=tubelet_size, **embed_kwargs)

        kwargs.setdefault("dynamic_img_size", True)
        super().__init__(embed_layer=embed_layer, **kwargs)

    def _check_input(self, x: torch.Tensor) -> None:
        self._check_batch(x, "B, C, T, H, W")
        frames, height, width = x.shape[-3:]
        ph, pw = self.patch_embed.patch_size
        ts = self.patch_embed.tubelet_size
        if frames % ts or height % ph or width % pw:
            raise ValueError(
                f"clip size {frames}x{height}x{width} (T x H x W) must be divisible by the tubelet {ts}x{ph}x{pw}"
            )

    def _grid_size(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape[1:4])  # the tubelet embedding's (B, T', H', W', D) output, for any clip size

    def forward_intermediates(self, *args, **kwargs):
        raise TypeError("VideoPEViT has no spatial feature maps to return; use forward_features (B, P + N, C)")
