"""timm registration: ``timm.create_model("visionpe_vit_small_patch16_224", pos_embed="rope_mixed")``.

Importing :mod:`visionpe` registers the models. There are no pretrained visionpe weights; to start from a
pretrained timm ViT, load its state dict with :func:`visionpe.load_timm_state_dict`, or pass a checkpoint file
through ``pretrained=True, pretrained_cfg_overlay={"file": path}`` (converted the same way).
"""

from __future__ import annotations

from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from ..models.convert import convert_timm_state_dict
from ..models.video_vit import VideoPEViT
from ..models.vit import VisionPEViT

__all__ = ["VisionPEViT", "VideoPEViT"]

_SIZES = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
}


def _cfg(**kwargs):
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
    {f"visionpe_vit_{size}_patch16_224": _cfg() for size in _SIZES}
    | {f"visionpe_video_vit_{size}_tubelet2x16": _cfg() for size in _SIZES}
)


def _filter_fn(state_dict, model):
    if "model" in state_dict:
        state_dict = state_dict["model"]
    if any(k.startswith("pos_schemes.") for k in state_dict):
        # already a visionpe checkpoint: only a learned table from another grid changes (resampled); every other
        # key goes to timm's loader as it is, so that a mismatch still fails loudly
        learned = "pos_schemes.learned.pos_embed"
        if learned in state_dict and learned in model.state_dict():
            return {**state_dict, **convert_timm_state_dict({learned: state_dict[learned]}, model)[0]}
        return state_dict
    return convert_timm_state_dict(state_dict, model)[0]


def _create(variant: str, size: str, pretrained: bool, **kwargs) -> VisionPEViT:
    args = dict(patch_size=16, **_SIZES[size])
    args.update(kwargs)
    return build_model_with_cfg(
        VisionPEViT,
        variant,
        pretrained,
        pretrained_filter_fn=_filter_fn,
        pretrained_strict=False,
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
