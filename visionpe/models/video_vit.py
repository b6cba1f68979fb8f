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

from ..checks import check_int
from ..contract import EntryPoint, register_entry_point
from .vit import VisionPEViT, _size_pair

__all__ = ["VIDEO_ENTRY", "TubeletEmbed", "VideoPEViT"]

#: ``timm.create_model("visionpe_video_vit_*", pos_embed=...)`` (:class:`VideoPEViT`): a 3D (t, y, x) grid, causal
#: attention (e.g. frames attending to earlier frames)
VIDEO_ENTRY = register_entry_point(
    EntryPoint(
        name='timm.create_model("visionpe_video_vit_*")',
        argument="pos_embed",
        kinds=("absolute", "rotary", "bias"),
        grid_rank=3,
        causal=True,
        label="`visionpe_video_vit_*`",
    )
)


def _check_clip_args(num_frames: Any, tubelet_size: Any) -> None:
    """ValueError (TypeError for a wrong type) unless ``num_frames`` and ``tubelet_size`` are positive ints and
    ``num_frames`` is a multiple of ``tubelet_size``."""
    check_int(num_frames, "num_frames", min=1)
    check_int(tubelet_size, "tubelet_size", min=1)
    if num_frames % tubelet_size:
        raise ValueError(f"num_frames must be divisible by tubelet_size={tubelet_size}, got {num_frames}")


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
        _check_clip_args(num_frames, tubelet_size)
        self.img_size, self.patch_size = _size_pair(img_size, "img_size"), _size_pair(patch_size, "patch_size")
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

    entry_point = VIDEO_ENTRY

    def __init__(self, num_frames: int = 16, tubelet_size: int = 2, **kwargs: Any) -> None:
        _check_clip_args(num_frames, tubelet_size)
        if kwargs.get("dynamic_img_pad", False) is not False:
            raise ValueError(
                "VideoPEViT does not pad frames: clips must be multiples of the tubelet; dynamic_img_pad must be "
                f"False, got {kwargs['dynamic_img_pad']!r}"
            )
        if kwargs.get("img_size", 224) is None:
            raise ValueError("img_size of a VideoPEViT must be a positive int or (H, W) pair, got None")

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
                f"x has clip size {frames}x{height}x{width} (T x H x W), not divisible by the tubelet {ts}x{ph}x{pw}"
            )

    def _grid_size(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape[1:4])  # the tubelet embedding's (B, T', H', W', D) output, for any clip size

    def forward_intermediates(self, *args, **kwargs):
        raise TypeError("VideoPEViT has no spatial feature maps to return; use forward_features (B, P + N, C)")
