"""Qwen-Image (``QwenImageTransformer2DModel``, and its ControlNet ``QwenImageControlNetModel``): its rotary in
visionpe.

Qwen-Image's MSRoPE (Wu et al., "Qwen-Image Technical Report", arXiv 2508.02324, 2025), diffusers'
``QwenEmbedRope(theta=10000, axes_dim=axes_dims_rope, scale_rope=True)``, numbers the tokens on three axes with
16, 56, 56 channels in the released model (float32 frequencies 10000^(-2j / d), float32 angles):

- image k of the list the model is given (``img_shapes``: Qwen-Image-Edit passes the generated image, then the
  condition images), of f frames and h x w tokens: index positions k, ..., k + f - 1; with ``scale_rope`` the rows
  centred on the image, -(h - h // 2), ..., -1, 0, ..., h // 2 - 1 (the first half negative), the columns likewise
  (without ``scale_rope``: 0, ..., h - 1);
- the i-th text token: position m + i on all three axes, m the largest max(h // 2, w // 2) over the images
  (max(h, w) without ``scale_rope``), i.e. the text follows the largest image position.

The module returns ``(image rotations (S_img, 64), text rotations (L, 64))`` as complex64 (``torch.polar``), which
the attention multiplies with the (real, imaginary) channel pairs; visionpe's :class:`QwenImageRotary` computes the
same from the same arguments with a :class:`DiffusionRotary` over the axes index, height, width (the index axis is
never scaled). The modes compare the number of positions per axis of the image (its h and w, the largest over the
images; not its largest position, the positions being centred) with the training grid.

The layered variant (``use_layer3d_rope=True``, diffusers' ``QwenEmbedLayer3DRope``: Qwen-Image-Layered) gives the
last image of the list, the condition image, the index position -1, starts the text after max(m, number of layers)
and takes ``(video_fhw, max_txt_seq_len, device)`` in that order: :class:`QwenImageLayeredRotary`.

Training grids (the modes' reference, :attr:`QWENIMAGE.default_train_grid`): the released Qwen-Image model card
gives 1328 x 1328 px as its 1:1 size (the other aspect ratios at about the same area, e.g. 1664 x 928), which the
8x VAE and the 2 x 2 packing make 83 x 83 tokens: (1, 83, 83). diffusers' pipeline defaults to 1024 px (64 x 64)
instead; pass ``train_grid_size`` to measure from another size. The layered model's pipeline takes the 640 or
1024 px buckets only: its default is the larger, (1, 64, 64).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from ...checks import check_int
from .patch import DiffusionFamily, register_family
from .rotary import DiffusionRotary

__all__ = ["QWENIMAGE", "QWENIMAGE_LAYERED_TRAIN_GRID", "QwenImageLayeredRotary", "QwenImageRotary"]

logger = logging.getLogger(__name__)

#: the layered model's default training grid: the larger of its pipeline's two buckets, 1024 px (64 x 64 tokens)
QWENIMAGE_LAYERED_TRAIN_GRID = (1, 64, 64)


def _shapes(video_fhw) -> list[tuple[int, int, int]]:
    # the images of the first sample, read as diffusers reads img_shapes (a list per sample, or one sample's shapes)
    if isinstance(video_fhw, list) and len(video_fhw) > 1 and not all(fhw == video_fhw[0] for fhw in video_fhw):
        logger.warning(
            "img_shapes differ across the batch (%s); the rotary of Qwen-Image, as diffusers', takes the first "
            "sample's shapes %s for every sample",
            video_fhw,
            video_fhw[0],
        )
    if isinstance(video_fhw, list):
        video_fhw = video_fhw[0]
    if not isinstance(video_fhw, list):
        video_fhw = [video_fhw]
    shapes = []
    for k, fhw in enumerate(video_fhw):
        if not isinstance(fhw, (tuple, list)) or len(fhw) != 3:
            raise ValueError(f"video_fhw[{k}] must be (frames, height, width), got {fhw!r}")
        shapes.append(tuple(check_int(v, f"video_fhw[{k}][{a}]", min=1) for a, v in enumerate(fhw)))
    return shapes


class QwenImageRotary(nn.Module):
    """Qwen-Image's ``pos_embed``: ``(video_fhw, device, max_txt_seq_len)`` in, ``(image, text)`` complex64
    rotations out, by a :class:`DiffusionRotary` over the axes index, height, width (float32, as the model).

    Args:
        axes_dim: the channels of the index, height and width blocks (``axes_dims_rope``).
        theta: the RoPE base (10000).
        train_grid_size: (index, height, width) training lengths, the modes' reference.
        scale_rope: centre the rows and columns on the image (the model's setting: True).
    """

    #: the last image of the list is the layered model's condition image, at index position -1
    layered = False

    def __init__(
        self,
        axes_dim: Sequence[int],
        theta: float,
        train_grid_size: Sequence[int] | None = None,
        *,
        scale_rope: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(scale_rope, bool):
            raise TypeError(f"scale_rope must be a bool, got {type(scale_rope).__name__}")
        self.rotary = DiffusionRotary(
            axes_dim,
            theta,
            ("index", "height", "width"),
            train_grid_size,
            fixed_axes=("index",),
            freqs_dtype=torch.float32,
        )
        self.scale_rope = scale_rope

    def _axis(self, n: int, device) -> torch.Tensor:
        pos = torch.arange(n, device=device)
        return pos - (n - n // 2) if self.scale_rope else pos

    def _embed(self, video_fhw, device, max_txt_seq_len) -> tuple[torch.Tensor, torch.Tensor]:
        if max_txt_seq_len is None:
            raise ValueError("max_txt_seq_len must be provided (the text sequence length), got None")
        if isinstance(max_txt_seq_len, torch.Tensor):
            max_txt_seq_len = int(max_txt_seq_len)  # a 0-d tensor under torch.compile, as diffusers reads it
        text_length = check_int(max_txt_seq_len, "max_txt_seq_len", min=0)
        device = torch.device("cpu") if device is None else torch.device(device)
        shapes = _shapes(video_fhw)
        last = len(shapes) - 1
        blocks, text_start, index_span = [], 0, 1
        for k, (frames, height, width) in enumerate(shapes):
            if self.layered and k == last:
                if frames != 1:
                    raise ValueError(
                        f"video_fhw[{k}] (the condition image of the layered rotary) must have 1 frame, got {frames}"
                    )
                index = torch.full((1,), -1, device=device)
            else:
                index = torch.arange(k, k + frames, device=device)
                index_span = max(index_span, k + frames)
            grid = torch.meshgrid(index, self._axis(height, device), self._axis(width, device), indexing="ij")
            blocks.append(torch.stack(grid, dim=-1).reshape(-1, 3))
            half = (height // 2, width // 2) if self.scale_rope else (height, width)
            text_start = max(text_start, *half)
        if self.layered:
            text_start = max(text_start, last)
        text = (text_start + torch.arange(text_length, device=device))[:, None].expand(text_length, 3)
        positions = torch.cat([*blocks, text], dim=0)
        # the modes' grid: positions per axis of the images (their sides, not their largest, centred, position)
        grid_size = None
        if self.rotary.extrapolation != "none":
            grid_size = (index_span, max(s[1] for s in shapes), max(s[2] for s in shapes))
        rotations = self.rotary.polar(positions, grid_size)
        return rotations[: len(positions) - text_length], rotations[len(positions) - text_length :]

    def forward(
        self, video_fhw, device: torch.device | None = None, max_txt_seq_len: int | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``video_fhw``: the model's ``img_shapes`` (a list of (frames, height, width) per sample, the first
        sample's taken); ``device``: where the rotations go (CPU when None); ``max_txt_seq_len``: the text length.
        Returns the image tokens' and the text tokens' rotations, complex64."""
        return self._embed(video_fhw, device, max_txt_seq_len)


class QwenImageLayeredRotary(QwenImageRotary):
    """The layered model's ``pos_embed`` (``QwenEmbedLayer3DRope``): its call signature
    ``(video_fhw, max_txt_seq_len, device)``, the last image at index position -1 and the text after
    max(m, number of layers)."""

    layered = True

    def forward(
        self, video_fhw, max_txt_seq_len: int | torch.Tensor, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._embed(video_fhw, device, max_txt_seq_len)


def _build(model: nn.Module, own: nn.Module, train_grid_size) -> QwenImageRotary:
    layered = type(own).__name__ == "QwenEmbedLayer3DRope"
    cls = QwenImageLayeredRotary if layered else QwenImageRotary
    default = QWENIMAGE_LAYERED_TRAIN_GRID if layered else QWENIMAGE.default_train_grid
    return cls(tuple(own.axes_dim), float(own.theta), train_grid_size or default, scale_rope=bool(own.scale_rope))


QWENIMAGE = register_family(
    DiffusionFamily(
        name="qwenimage",
        class_names=("QwenImageTransformer2DModel", "QwenImageControlNetModel"),
        attribute="pos_embed",
        build=_build,
        # the pipelines pass timestep / 1000: the flow-matching sigma, in [0, 1] already
        timestep_scale=1.0,
        axis_names=("index", "height", "width"),
        default_train_grid=(1, 83, 83),
        own_module_class=("QwenEmbedRope", "QwenEmbedLayer3DRope"),
    )
)
