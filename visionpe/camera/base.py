"""The interface between camera-aware schemes, the attention and the multi-view model.

A camera scheme has ``kind == "camera"`` and reads :class:`~visionpe.camera.cameras.Cameras` besides the patch grid
of each view. It enters the model in one of two ways:

- :class:`RelativeCameraEncoding` (GTA, RayRoPE, CaPE) acts inside attention. ``prepare(cameras, grid_size)``
  runs once per forward and returns a :class:`CameraState`; each block asks it for its :class:`CameraTransform`
  (``state.layer(i, tokens)``; ``tokens`` is the block's normalised input for schemes with ``needs_tokens``, e.g.
  RayRoPE's predicted depths), whose :meth:`CameraTransform.attend` wraps the attention call. Most schemes map q, k
  and v before scaled-dot-product attention and the output after it (:class:`QKVCameraTransform`); a scheme whose
  keys depend on the query's camera (RayRoPE) runs one attention per query camera. Nothing of size N x N is built.
- :class:`AbsoluteCameraEncoding` (PETR, 3DPPE) adds an embedding of each patch's 3D position to the tokens before
  the blocks: ``forward(x, cameras, grid_size)``.

Tokens are ordered (view, row, column): (B, V * N, ...) with N = h * w patches per view; the multi-view model has
no prefix tokens. Every transform acts per head on the (B, heads, V * N, head_dim) tensors attention holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from ..base import PositionEncoding
from ..checks import describe
from .cameras import Cameras

__all__ = [
    "CameraPositionEncoding",
    "RelativeCameraEncoding",
    "AbsoluteCameraEncoding",
    "CameraState",
    "CameraTransform",
    "QKVCameraTransform",
    "view_blocks_matmul",
]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def view_blocks_matmul(x: torch.Tensor, mats: torch.Tensor, num_views: int) -> torch.Tensor:
    """Multiply every k-channel block of each token by its view's matrix.

    ``x`` (B, heads, V * N, c) with c a multiple of k, tokens ordered (view, patch); ``mats`` (B, V, k, k) or
    (B, V, heads, k, k) (one matrix per view, or per view and head). Returns (B, heads, V * N, c) with
    ``out[b, h, v * N + n, j * k : (j + 1) * k] = mats[b, v] @ x[b, h, v * N + n, j * k : (j + 1) * k]``
    (column vectors), as one batched matmul over a view of ``x``.
    """
    batch, heads, tokens, channels = x.shape
    size = mats.shape[-1]
    if mats.ndim == 4:
        mats = mats[:, None]  # (B, 1, V, k, k)
    else:
        mats = mats.transpose(1, 2)  # (B, heads, V, k, k)
    blocks = x.reshape(batch, heads, num_views, tokens // num_views * (channels // size), size)
    return (blocks @ mats.transpose(-1, -2)).reshape(batch, heads, tokens, channels)


class CameraTransform(ABC):
    """One block's camera-dependent attention for one forward (see the module docstring)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Attention of q over k and v (each (B, heads, V * N, head_dim)) with this block's camera encoding.
        ``attend`` is the attention itself (scaled dot product, with any bias or mask of the model), which the
        transform calls once, or once per query camera."""


class QKVCameraTransform(CameraTransform):
    """A camera transform that maps q, k and v once for all queries, and the output back (GTA, CaPE)."""

    @abstractmethod
    def transform_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (each (B, heads, V * N, head_dim)) as attention compares and averages them."""

    def untransform_output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention's output (B, heads, V * N, head_dim) mapped back by each query's camera; identity by default
        (schemes that leave v unchanged)."""
        return o

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``untransform_output(attend(*transform_qkv(q, k, v)))``."""
        return self.untransform_output(attend(*self.transform_qkv(q, k, v)))


class CameraState(ABC):
    """What a relative camera scheme's ``prepare`` builds once per forward for all blocks."""

    @abstractmethod
    def layer(self, index: int, tokens: torch.Tensor | None = None) -> CameraTransform:
        """The transform of block ``index``; ``tokens`` (B, V * N, C), the block's normalised input, for schemes
        with ``needs_tokens``."""


class CameraPositionEncoding(PositionEncoding):
    """A position encoding that reads the cameras of a multi-view batch (``kind == "camera"``)."""

    kind: ClassVar[str] = "camera"
    ndims: ClassVar[tuple[int, ...]] = (2,)
    requires: ClassVar[frozenset[str]] = frozenset({"cameras"})
    #: "attention": a :class:`RelativeCameraEncoding`; "tokens": an :class:`AbsoluteCameraEncoding`
    applies_to: ClassVar[str] = ""
    #: the scheme's per-block transform reads the block's tokens (``CameraState.layer(i, tokens)``)
    needs_tokens: ClassVar[bool] = False

    def check_cameras(self, cameras: Cameras, grid_size: tuple[int, ...]) -> tuple[int, int]:
        """TypeError unless ``cameras`` is a :class:`Cameras`; returns the checked per-view ``grid_size``."""
        if not isinstance(cameras, Cameras):
            raise TypeError(f"cameras must be a visionpe.camera.Cameras, got {describe(cameras)}")
        return self.check_grid(grid_size)


class RelativeCameraEncoding(CameraPositionEncoding, ABC):
    """A camera scheme applied inside attention (see the module docstring)."""

    applies_to = "attention"

    @abstractmethod
    def prepare(self, cameras: Cameras, grid_size: tuple[int, int]) -> CameraState:
        """Per-forward state for ``cameras`` (B, V views) whose images are cut into ``grid_size`` (h, w) patches."""


class AbsoluteCameraEncoding(CameraPositionEncoding, ABC):
    """A camera scheme added to the patch tokens before the blocks (see the module docstring)."""

    applies_to = "tokens"

    @abstractmethod
    def forward(self, x: torch.Tensor, cameras: Cameras, grid_size: tuple[int, int]) -> torch.Tensor:
        """``x`` (B, V * N, C), tokens ordered (view, patch) -> the same with each patch's embedding added."""

    def check_tokens(self, x: torch.Tensor, cameras: Cameras, grid_size: tuple[int, int], dim: int) -> tuple[int, int]:
        """Validate :meth:`forward`'s arguments; returns the grid."""
        grid_size = self.check_cameras(cameras, grid_size)
        tokens = cameras.num_views * grid_size[0] * grid_size[1]
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point (B, V * N, C) tensor, got {describe(x)}")
        if x.shape != (cameras.batch_size, tokens, dim):
            raise ValueError(
                f"x must be (B, V * N, C) = ({cameras.batch_size}, {cameras.num_views} * {grid_size[0] * grid_size[1]}"
                f", {dim}) for the cameras and grid {grid_size}, got {tuple(x.shape)}"
            )
        return grid_size
