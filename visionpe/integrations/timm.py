"""timm registration: ``timm.create_model("visionpe_vit_small_patch16_224", pos_embed="rope_mixed")``.

Importing :mod:`visionpe` registers the models. There are no pretrained visionpe weights; to start from a
pretrained timm ViT, load its state dict with :func:`visionpe.load_timm_state_dict`, or pass a checkpoint file
through ``pretrained=True, pretrained_cfg_overlay={"file": path}`` (converted the same way; a visionpe checkpoint
must carry exactly the model's position schemes). ``features_only=True`` works as for timm's ViT (per-block
(B, C, H, W) maps through ``forward_intermediates``, the last 3 blocks unless ``out_indices`` says otherwise).

To keep a pretrained timm model and change its position encoding in place (EVA-02, DINOv3, timm's RoPE ViTs, any
``VisionTransformer``, timm's ``NaFlexVit``), use :func:`apply_position_scheme`
(:mod:`visionpe.integrations.timm_swap`).
"""

from __future__ import annotations

from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from ..models.convert import convert_timm_state_dict
from ..models.multiview_vit import MultiViewViT
from ..models.video_vit import VideoPEViT
from ..models.vit import VisionPEViT
from .timm_swap import SwapReport, VisionPEEva, VisionPENaFlexVit, apply_position_scheme, own_position_scheme

__all__ = [
    "VisionPEViT",
    "VideoPEViT",
    "MultiViewViT",
    "VisionPEEva",
    "VisionPENaFlexVit",
    "SwapReport",
    "apply_position_scheme",
    "own_position_scheme",
]

_SIZES = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
}


def _cfg(**kwargs):
    """Pretrained cfg as timm's ViTs declare it; ``fixed_input_size=True`` for the image ViTs (they take the
    ``img_size`` they were built with unless created with ``dynamic_img_size=True``), False for the video and
    multi-view ViTs (dynamic by default)."""
    return {
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": IMAGENET_INCEPTION_MEAN,
        "std": IMAGENET_INCEPTION_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {f"visionpe_vit_{size}_patch16_224": _cfg(fixed_input_size=True) for size in _SIZES}
    | {f"visionpe_video_vit_{size}_tubelet2x16": _cfg() for size in _SIZES}
    | {f"visionpe_mvvit_{size}_patch16": _cfg() for size in ("tiny", "small", "base")}
)


def _filter_fn(state_dict, model):
    """timm's ``pretrained_filter_fn``: a timm ViT or visionpe checkpoint -> a state dict for ``model``.

    The load that follows is not strict (``pretrained_strict=False``) so that a vanilla timm checkpoint can fill a
    model whose position parameters it lacks (they keep their init, its ``pos_embed`` goes to a learned table or
    is dropped) and so that timm can drop a classifier of another ``num_classes``. A visionpe checkpoint carries
    its scheme's parameters, so for it a scheme mismatch (position keys missing or unexpected) is an error here.
    """
    if "model" in state_dict:
        state_dict = state_dict["model"]
    state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
    try:
        if any(k.startswith("pos_schemes.") for k in state_dict):
            # already a visionpe checkpoint: only tables from another grid change (resampled: the learned table and
            # the grid-shaped parameters a scheme resamples itself); every other key goes to timm's loader as it is
            # (a shape mismatch fails there)
            _check_same_schemes(state_dict, model)
            target = model.state_dict()
            other_grid = {k: v for k, v in state_dict.items() if k in target and v.shape != target[k].shape}
            if other_grid:
                return {**state_dict, **convert_timm_state_dict(other_grid, model)[0]}
            return state_dict
        return convert_timm_state_dict(state_dict, model)[0]
    except TypeError as e:  # timm retries a filter that raises TypeError with one argument, hiding the cause
        raise ValueError(f"cannot load the checkpoint into {type(model).__name__}: {e}") from e


def _check_same_schemes(state_dict, model) -> None:
    """ValueError naming the position-scheme keys of a visionpe checkpoint that ``model`` lacks or needs."""
    ours = {k for k in model.state_dict() if k.startswith("pos_schemes.")}
    theirs = {k for k in state_dict if k.startswith("pos_schemes.")}
    missing, unexpected = sorted(ours - theirs), sorted(theirs - ours)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint was saved with other position schemes than the model's pos_embed={model.pos_embed_names}: "
            f"missing position keys {missing}, unexpected position keys {unexpected}"
        )


def feature_cfg(args: dict) -> dict:
    """timm's ``feature_cfg`` for a :class:`VisionPEViT`, as timm's ViT builds it: features through
    ``forward_intermediates`` (``feature_cls="getter"``), the last 3 blocks unless ``args`` has ``out_indices``
    (popped from ``args``, which then go to the model)."""
    return dict(out_indices=args.pop("out_indices", 3), feature_cls="getter")


def _create(variant: str, size: str, pretrained: bool, **kwargs) -> VisionPEViT:
    args = dict(patch_size=16, **_SIZES[size])
    args.update(kwargs)
    return build_model_with_cfg(
        VisionPEViT,
        variant,
        pretrained,
        pretrained_filter_fn=_filter_fn,
        pretrained_strict=False,
        feature_cfg=feature_cfg(args),
        **args,
    )


@register_model
def visionpe_vit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionPEViT:
    """ViT-Ti/16 (dim 192, depth 12, 3 heads) with ``pos_embed=`` any visionpe scheme."""
    return _create("visionpe_vit_tiny_patch16_224", "tiny", pretrained, **kwargs)


@register_model
def visionpe_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionPEViT:
    """ViT-S/16 (dim 384, depth 12, 6 heads) with ``pos_embed=`` any visionpe scheme."""
    return _create("visionpe_vit_small_patch16_224", "small", pretrained, **kwargs)


@register_model
def visionpe_vit_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionPEViT:
    """ViT-B/16 (dim 768, depth 12, 12 heads) with ``pos_embed=`` any visionpe scheme."""
    return _create("visionpe_vit_base_patch16_224", "base", pretrained, **kwargs)


@register_model
def visionpe_vit_large_patch16_224(pretrained: bool = False, **kwargs) -> VisionPEViT:
    """ViT-L/16 (dim 1024, depth 24, 16 heads) with ``pos_embed=`` any visionpe scheme."""
    return _create("visionpe_vit_large_patch16_224", "large", pretrained, **kwargs)


def _create_video(variant: str, size: str, pretrained: bool, **kwargs) -> VideoPEViT:
    if kwargs.get("features_only"):
        raise ValueError(
            f"{variant} does not support features_only=True: a video ViT has no 2D feature maps; "
            "use forward_features for its (B, P + N, C) tokens"
        )
    args = dict(patch_size=16, num_frames=16, tubelet_size=2, **_SIZES[size])
    args.update(kwargs)
    return build_model_with_cfg(VideoPEViT, variant, pretrained, **args)


@register_model
def visionpe_video_vit_tiny_tubelet2x16(pretrained: bool = False, **kwargs) -> VideoPEViT:
    """Video ViT-Ti with 2x16x16 tubelets, 16 frames; ``pos_embed=`` a 3D-capable scheme."""
    return _create_video("visionpe_video_vit_tiny_tubelet2x16", "tiny", pretrained, **kwargs)


@register_model
def visionpe_video_vit_small_tubelet2x16(pretrained: bool = False, **kwargs) -> VideoPEViT:
    """Video ViT-S with 2x16x16 tubelets, 16 frames; ``pos_embed=`` a 3D-capable scheme."""
    return _create_video("visionpe_video_vit_small_tubelet2x16", "small", pretrained, **kwargs)


@register_model
def visionpe_video_vit_base_tubelet2x16(pretrained: bool = False, **kwargs) -> VideoPEViT:
    """Video ViT-B with 2x16x16 tubelets, 16 frames; ``pos_embed=`` a 3D-capable scheme."""
    return _create_video("visionpe_video_vit_base_tubelet2x16", "base", pretrained, **kwargs)


def _create_multiview(variant: str, size: str, pretrained: bool, **kwargs) -> MultiViewViT:
    if kwargs.get("features_only"):
        raise ValueError(
            f"{variant} does not support features_only=True: its forward takes cameras besides the images; use "
            "forward_intermediates(x, cameras) or forward_view_features(x, cameras) for per-view feature maps"
        )
    args = dict(patch_size=16, **_SIZES[size])
    args.update(kwargs)
    return build_model_with_cfg(MultiViewViT, variant, pretrained, **args)


@register_model
def visionpe_mvvit_tiny_patch16(pretrained: bool = False, **kwargs) -> MultiViewViT:
    """Multi-view ViT-Ti/16 (dim 192, depth 12, 3 heads): ``camera_embed=`` a camera scheme, ``pos_embed=`` a
    within-view 2D scheme; called as ``model(images (B, V, C, H, W), cameras)``."""
    return _create_multiview("visionpe_mvvit_tiny_patch16", "tiny", pretrained, **kwargs)


@register_model
def visionpe_mvvit_small_patch16(pretrained: bool = False, **kwargs) -> MultiViewViT:
    """Multi-view ViT-S/16 (dim 384, depth 12, 6 heads); see :func:`visionpe_mvvit_tiny_patch16`."""
    return _create_multiview("visionpe_mvvit_small_patch16", "small", pretrained, **kwargs)


@register_model
def visionpe_mvvit_base_patch16(pretrained: bool = False, **kwargs) -> MultiViewViT:
    """Multi-view ViT-B/16 (dim 768, depth 12, 12 heads); see :func:`visionpe_mvvit_tiny_patch16`."""
    return _create_multiview("visionpe_mvvit_base_patch16", "base", pretrained, **kwargs)
