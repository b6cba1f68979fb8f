"""A multi-view ViT: several images of one scene, each with its camera, in one transformer.

``MultiViewViT`` subclasses :class:`~visionpe.models.vit.VisionPEViT` (so timm's patch embedding, blocks, pooling,
head and init). Each of the V images of a sample is cut into patches by the shared patch embedding; the tokens of all
views are concatenated in (view, row, column) order and attend to each other in every block. Two kinds of position
information enter:

- **within a view**, any absolute or rotary 2D scheme (``pos_embed``): absolute ones are added to each view's tokens
  on that view's grid; rotary ones rotate by each token's (row, column) in its own view, so two tokens of different
  views are compared by their in-image offset;
- **between views**, camera schemes (``camera_embed``, :mod:`visionpe.camera`): relative ones (``gta``, ``rayrope``,
  ``cape``) transform q, k, v and the output in attention from the cameras' poses; absolute ones (``petr``,
  ``3dppe``) add an embedding of each patch's 3D ray or point to its token.

Bias schemes within a view are not offered: their bias is built for one grid's offsets and has no meaning between
two views' grids. The model has no prefix tokens (no class token); it pools the tokens of all views (``"avg"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..attention import PositionContext
from ..camera.base import AbsoluteCameraEncoding, RelativeCameraEncoding
from ..camera.cameras import Cameras
from ..checks import ArgumentTypeError, check_int, describe
from ..contract import EntryPoint, check_built_scheme, register_entry_point
from ..interfaces.rotary import LayerRotation, RotaryState
from ..registry import create_pos_embed
from .vit import VisionPEViT, _check_images, _feature_indices, normalize_schemes

__all__ = ["MULTIVIEW_ENTRY", "MULTIVIEW_CAMERA_ENTRY", "MultiViewViT", "ViewTiledRotation", "ViewTiledState"]

#: the within-view schemes of ``timm.create_model("visionpe_mvvit_*", pos_embed=...)`` (:class:`MultiViewViT`):
#: absolute or rotary, each view on its own 2D grid (a bias is built for one grid's offsets and has no meaning
#: between two views)
MULTIVIEW_ENTRY = register_entry_point(
    EntryPoint(
        name='timm.create_model("visionpe_mvvit_*")',
        argument="pos_embed",
        kinds=("absolute", "rotary"),
        label="`visionpe_mvvit_*` `pos_embed`",
    )
)
#: the camera schemes of the multi-view ViT (``camera_embed=...``): the views' cameras and, when given, their depths
MULTIVIEW_CAMERA_ENTRY = register_entry_point(
    EntryPoint(
        name='timm.create_model("visionpe_mvvit_*")',
        argument="camera_embed",
        kinds=("camera",),
        provides=frozenset({"cameras", "patch_depth"}),
        label="`visionpe_mvvit_*` `camera_embed`",
    )
)


class ViewTiledRotation(LayerRotation):
    """A within-view rotation prepared for one view's N patches, applied to the V * N tokens of V views: each view's
    tokens are rotated by the same per-patch rotation (q, k (..., B, heads, V * N, head_dim) are viewed as
    (..., B, V, heads, N, head_dim), so the scheme's tables broadcast over the views)."""

    def __init__(self, inner: LayerRotation, num_views: int) -> None:
        self.inner, self.num_views = inner, num_views
        self.num_tokens = inner.num_tokens * num_views

    @property
    def basis(self) -> torch.Tensor | None:
        return self.inner.basis

    def without_basis(self) -> LayerRotation:
        inner = self.inner.without_basis()
        return self if inner is self.inner else ViewTiledRotation(inner, self.num_views)

    def _per_view(self, x: torch.Tensor, fn) -> torch.Tensor:
        # (..., B, heads, V * N, d) -> (..., B, V, heads, N, d): a view, the views in front of the heads
        tiled = x.unflatten(-2, (self.num_views, -1)).transpose(-4, -3)
        return fn(tiled).transpose(-4, -3).flatten(-3, -2)

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        return self._per_view(qk, self.inner.rotate)

    def rotate_values(self, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self._per_view(v, self.inner.rotate_values)

    def unrotate_output(self, o: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self._per_view(o, self.inner.unrotate_output)


class ViewTiledState(RotaryState):
    """A within-view rotary state whose blocks rotate all views alike (:class:`ViewTiledRotation`)."""

    def __init__(self, inner: RotaryState, num_views: int) -> None:
        self.inner, self.num_views = inner, num_views

    def layer(self, index: int) -> LayerRotation:
        return ViewTiledRotation(self.inner.layer(index), self.num_views)


class MultiViewViT(VisionPEViT):
    """Multi-view classifier: images (B, V, C, H, W) with their :class:`~visionpe.camera.Cameras` -> logits.

    Args:
        camera_embed: camera scheme name (``visionpe.list_schemes("camera")``) or a list of them; None (default) or
            ``"none"`` for a model without camera information (the baseline).
        camera_embed_kwargs: options of the camera scheme (flat for one scheme, else keyed by name).
        num_views: views per sample of the training data (default cfg only: any number of views runs).
        pos_embed, pos_embed_kwargs: the within-view 2D scheme(s), absolute or rotary (default ``"none"``).
        **kwargs: timm ``VisionTransformer`` arguments (``img_size``, ``patch_size``, ``embed_dim``, ``depth``...).
            ``class_token`` and ``reg_tokens`` must stay off and ``global_pool`` is ``"avg"`` by default.

    ``forward(x, cameras)`` returns (B, num_classes) logits, ``forward_features`` the (B, V * N, C) normalised tokens
    and ``forward_view_features`` (B, V, C, h, w) maps for dense heads.

    Example:
        >>> import timm, torch, visionpe
        >>> from visionpe.camera import Cameras, look_at
        >>> model = timm.create_model("visionpe_mvvit_tiny_patch16", camera_embed="gta", img_size=32, depth=2,
        ...                           num_classes=4)
        >>> eyes = torch.tensor([[[0.0, 0, -3], [3.0, 0, 0]]])
        >>> K = torch.tensor([[32.0, 0, 16], [0, 32.0, 16], [0, 0, 1]]).expand(1, 2, 3, 3)
        >>> cameras = Cameras(look_at(eyes, torch.zeros(1, 2, 3)), K, (32, 32))
        >>> model(torch.randn(1, 2, 3, 32, 32), cameras).shape
        torch.Size([1, 4])
    """

    entry_point = MULTIVIEW_ENTRY

    def __init__(
        self,
        camera_embed: str | Sequence[str] | None = None,
        camera_embed_kwargs: dict[str, Any] | None = None,
        num_views: int = 2,
        pos_embed: str | Sequence[str] = "none",
        pos_embed_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.num_views = check_int(num_views, "num_views", min=1)
        for key, allowed in (("class_token", False), ("reg_tokens", 0), ("patch_drop_rate", 0.0)):
            if kwargs.get(key, allowed) != allowed:
                raise ValueError(
                    f"MultiViewViT has no prefix tokens and keeps every view's patches: {key} must be {allowed!r}, "
                    f"got {kwargs[key]!r}"
                )
        kwargs.update(class_token=False, reg_tokens=0)
        kwargs.setdefault("global_pool", "avg")
        kwargs.setdefault("dynamic_img_size", True)
        super().__init__(pos_embed=pos_embed, pos_embed_kwargs=pos_embed_kwargs, **kwargs)
        self.camera_schemes = nn.ModuleDict()
        if camera_embed is not None and camera_embed != "none":
            cameras = normalize_schemes(camera_embed, camera_embed_kwargs, MULTIVIEW_CAMERA_ENTRY)
            depth, num_heads = len(self.blocks), self.blocks[0].attn.num_heads
            for name, opts in cameras.items():
                self.camera_schemes[name] = create_pos_embed(
                    name, dim=self.embed_dim, num_heads=num_heads, depth=depth, **opts
                )
                check_built_scheme(MULTIVIEW_CAMERA_ENTRY, name, self.camera_schemes[name])
        self.camera_embed_names = list(self.camera_schemes)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """As :meth:`VisionPEViT.group_matcher`, with the camera schemes in the stem group (they act on every
        block, like the within-view position parameters)."""
        groups = super().group_matcher(coarse)
        groups["stem"] = groups["stem"].replace("pos_schemes(?:\\.|$)", "(?:pos|camera)_schemes(?:\\.|$)")
        return groups

    # -- input ------------------------------------------------------------------------------------------------
    def _check_views(self, x: torch.Tensor, cameras: Cameras) -> None:
        """The images (B, V, C, H, W), checked as a whole (messages show the shape given), and their cameras."""
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"x must be a multi-view batch (B, V, C, H, W), a tensor, got {describe(x)}")
        if x.ndim != 5:
            raise ValueError(f"x must be a multi-view batch (B, V, C, H, W), got {describe(x)}")
        _check_images(x, *self._input_options(), dtype=self._input_dtype(), layout="B, V, C, H, W")
        if not isinstance(cameras, Cameras):
            raise TypeError(f"cameras must be a visionpe.camera.Cameras, got {describe(cameras)}")
        cameras.check_batch(x.shape[0], x.shape[1], tuple(x.shape[-2:]))

    def _depth_readers(self) -> tuple[list[str], list[str]]:
        """(camera schemes that need depths, camera schemes that take them when given)."""
        needs = [n for n, s in self.camera_schemes.items() if "patch_depth" in s.extra_inputs]
        takes = [n for n, s in self.camera_schemes.items() if "patch_depth" in s.optional_inputs]
        return needs, takes

    def _view_patch_depth(self, depth: torch.Tensor | None, x: torch.Tensor, grid_size: tuple[int, int]):
        """(B, V, N) mean depth of each patch of ``depth`` (B, V, H, W) or (B, V, 1, H, W), the views' depth maps."""
        needs, takes = self._depth_readers()
        if depth is None:
            if needs:
                raise ValueError(
                    f"camera scheme(s) {needs} read known depths: call the model with depth=(B, V, H, W), the views' "
                    "depth maps, got depth=None"
                )
            return None
        if not needs and not takes:
            raise ValueError(
                f"depth= is read by camera schemes with known depths (rayrope with depth_source='known', 3dppe); this "
                f"model's camera schemes {self.camera_embed_names} take none, got depth of shape {describe(depth)}"
            )
        if not isinstance(depth, torch.Tensor) or not depth.is_floating_point():
            raise TypeError(f"depth must be a floating-point (B, V, H, W) tensor, got {describe(depth)}")
        if depth.ndim == 5 and depth.shape[2] == 1:
            depth = depth.squeeze(2)
        if depth.shape != (*x.shape[:2], *x.shape[-2:]):
            raise ValueError(
                f"depth must be (B, V, H, W) or (B, V, 1, H, W) matching the images {tuple(x.shape)}, got "
                f"{tuple(depth.shape)}"
            )
        patch = self.patch_embed.patch_size
        with torch.autocast(depth.device.type, enabled=False):
            pooled = torch.nn.functional.avg_pool2d(depth.flatten(0, 1).float(), patch, patch, ceil_mode=True)
        if tuple(pooled.shape[-2:]) != tuple(grid_size):
            raise ValueError(f"depth pools to a {tuple(pooled.shape[-2:])} grid, but the patches form {grid_size}")
        return pooled.reshape(*x.shape[:2], -1)

    def _blocks(  # type: ignore[override]
        self, x: torch.Tensor, cameras: Cameras, last: int | None = None, depth: torch.Tensor | None = None
    ):
        """Embed every view, add the absolute encodings, then yield the (B, V * N, C) tokens after each block."""
        self._check_views(x, cameras)
        batch, views = x.shape[:2]
        tokens = self.patch_embed(x.flatten(0, 1))
        grid_size = self._grid_size(tokens)
        patch_depth = self._view_patch_depth(depth, x, grid_size)
        tokens = tokens.reshape(batch * views, -1, self.embed_dim)
        for scheme in self._schemes("absolute"):
            if not scheme.insert_after:
                tokens = scheme(tokens, grid_size, 0)
        tokens = tokens.reshape(batch, -1, self.embed_dim)
        cameras = cameras.to(device=tokens.device)
        _, takes = self._depth_readers()
        for name, scheme in self.camera_schemes.items():
            if isinstance(scheme, AbsoluteCameraEncoding):
                extra = {"depth": patch_depth} if patch_depth is not None and name in takes else {}
                tokens = scheme(tokens, cameras, grid_size, **extra)
        x = self.norm_pre(self.pos_drop(tokens))
        ctx = self.view_position_context(cameras, grid_size, x.device, patch_depth)

        def insert(scheme: nn.Module, tokens: torch.Tensor, i: int) -> torch.Tensor:  # view by view
            tokens = scheme(tokens.reshape(batch * views, -1, self.embed_dim), grid_size, 0, after_block=i)
            return tokens.reshape(batch, -1, self.embed_dim)

        yield from self._run_blocks(x, ctx, last, insert)

    def view_position_context(
        self,
        cameras: Cameras,
        grid_size: tuple[int, int],
        device: torch.device,
        patch_depth: torch.Tensor | None = None,
    ) -> PositionContext:
        """The blocks' :class:`~visionpe.attention.PositionContext`: the within-view rotary states tiled over the
        views and every relative camera scheme's state (``patch_depth`` (B, V, N) to those that read depths)."""
        ctx = PositionContext()
        for scheme in self._schemes("rotary"):
            coords = scheme.model_coords(grid_size, device)
            ctx.rotary.append(ViewTiledState(scheme.prepare(coords, 0, grid_size=grid_size), cameras.num_views))
        for scheme in self.camera_schemes.values():
            if isinstance(scheme, RelativeCameraEncoding):
                extra = {"patch_depth": patch_depth} if "patch_depth" in scheme.extra_inputs else {}
                ctx.camera.append((scheme, scheme.prepare(cameras, grid_size, **extra)))
        return ctx

    # -- forward ----------------------------------------------------------------------------------------------
    def forward_features(  # type: ignore[override]
        self, x: torch.Tensor, cameras: Cameras, depth: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, V, C, H, W) images and their cameras -> (B, V * N, C) normalised tokens, ordered (view, patch).

        ``depth`` (B, V, H, W): the views' depth maps, for camera schemes that read known depths (``rayrope`` with
        ``depth_source="known"``; ``3dppe``, which predicts depths without it); each patch gets its mean depth."""
        tokens = x
        for tokens in self._blocks(x, cameras, depth=depth):  # noqa: B007 - the last block's output
            pass
        return self.norm(tokens)

    def forward_view_features(
        self, x: torch.Tensor, cameras: Cameras, depth: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, V, C, h, w) per-view feature maps of the normalised tokens (for dense heads); ``depth`` as
        :meth:`forward_features`."""
        tokens = self.forward_features(x, cameras, depth)
        batch, views = x.shape[:2]
        h, w = self.patch_embed.dynamic_feat_size(tuple(x.shape[-2:]))
        return tokens.reshape(batch, views, h, w, -1).permute(0, 1, 4, 2, 3)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, cameras: Cameras, depth: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, V, C, H, W) images and their cameras -> (B, num_classes) logits (pooled over every view's tokens);
        ``depth`` as :meth:`forward_features`."""
        return self.forward_head(self.forward_features(x, cameras, depth))

    def forward_intermediates(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cameras: Cameras,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        depth: torch.Tensor | None = None,
    ):
        """timm's feature API for multi-view input: the tokens after the blocks ``indices`` (last n if int, all if
        None), each (B, V, C, h, w) with ``output_fmt="NCHW"`` or (B, V * N, C) with ``"NLC"``. Returns (final
        normalised tokens, [features]), or the features alone with ``intermediates_only``."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = _feature_indices(indices, len(self.blocks))
        self._check_views(x, cameras)  # before x.shape is read
        batch, views = x.shape[:2]
        h, w = self.patch_embed.dynamic_feat_size(tuple(x.shape[-2:]))
        intermediates, tokens = [], x
        for i, tokens in enumerate(self._blocks(x, cameras, max_index if stop_early else None, depth)):
            if i in take_indices:
                y = self.norm(tokens) if norm else tokens
                if output_fmt == "NCHW":
                    y = y.reshape(batch, views, h, w, -1).permute(0, 1, 4, 2, 3)
                intermediates.append(y)
        if intermediates_only:
            return intermediates
        return self.norm(tokens), intermediates
