"""open_clip towers: a CLIP model whose image tower is a visionpe ViT, built by open_clip's own factory.

Radford et al., "Learning Transferable Visual Models From Natural Language Supervision", ICML 2021;
open_clip (Ilharco et al., 2021) builds timm towers by name from a model config with ``timm_model_name``.
:func:`register_open_clip_model` registers (1) a timm entrypoint that builds
:class:`~visionpe.models.vit.VisionPEViT` with the chosen position scheme and (2) an open_clip model config
that names it, so that ``open_clip.create_model(name)`` returns the CLIP model. The tower is created with
``dynamic_img_size=True``: it also runs at resolutions other than the training one.

Needs the ``clip`` extra (from a clone: ``pip install -e ".[clip]"``, open_clip_torch); importing this module without
it raises an ImportError that says so. ``import visionpe`` never imports it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import tempfile
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from timm.models import build_model_with_cfg, is_model, register_model
from timm.models.vision_transformer import VisionTransformer

try:
    import open_clip  # noqa: F401  (used by the functions below)
except ImportError as err:
    raise ImportError(
        'visionpe.integrations.open_clip needs the "clip" extra (open_clip is missing); from a clone of visionpe: '
        'pip install -e ".[clip]"'
    ) from err

from ..checks import ArgumentTypeError, check_int
from ..contract import EntryPoint, register_entry_point
from ..models.vit import VisionPEViT, check_vit_args, normalize_schemes
from .timm import feature_cfg

__all__ = ["register_open_clip_model", "register_visionpe_tower"]

# Entrypoints live in a module of their own: timm appends every registered name to its module's __all__.
_TOWERS = sys.modules.setdefault(
    "visionpe_open_clip_towers", types.ModuleType("visionpe_open_clip_towers", "timm towers for open_clip")
)
# tower name -> the open_clip name that registered it (kept on that module too, so that it survives a reload)
_TOWER_OWNERS: dict[str, str] = _TOWERS.__dict__.setdefault("open_clip_names", {})
_CONFIG_DIR: Path | None = None
_POSITIVE_TEXT_SIZES = ("context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio")
# the keyword arguments a tower takes besides those register_visionpe_tower names (fail at registration, not when
# open_clip builds the model)
_VIT_ARGUMENTS = {
    name
    for cls in (VisionPEViT, VisionTransformer)
    for name, p in inspect.signature(cls.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY or p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
} - {"self", "pos_embed", "pos_embed_kwargs", "img_size", "patch_size", "embed_dim", "depth", "num_heads"}

#: the image tower of an open_clip model (:func:`register_open_clip_model`): open_clip calls it with images alone
#: (no depth maps, no causal attention, no mixed-resolution batch)
OPEN_CLIP_ENTRY = register_entry_point(
    EntryPoint(
        name="visionpe.integrations.open_clip.register_open_clip_model",
        argument="pos_embed",
        kinds=("absolute", "rotary", "bias"),
        label="open_clip tower",
        # the tower runs VisionPEViT's forward, which hands the input image to a scheme that reads it (LOOPE)
        provides=frozenset({"pixels"}),
    )
)


class OpenCLIPTower(VisionPEViT):
    """The :class:`VisionPEViT` of an open_clip image tower: its schemes are checked against what open_clip passes."""

    entry_point = OPEN_CLIP_ENTRY


def register_visionpe_tower(
    tower_name: str,
    *,
    pos_embed: str | Sequence[str],
    pos_embed_kwargs: dict[str, Any] | None = None,
    img_size: int = 224,
    patch_size: int = 16,
    embed_dim: int = 384,
    depth: int = 12,
    num_heads: int = 6,
    **vit_kwargs: Any,
) -> str:
    """Register ``tower_name`` with timm: a VisionPEViT with ``pos_embed``, any input size, no pretrained weights.

    The arguments are :class:`VisionPEViT`'s (``vit_kwargs`` go to timm's ``VisionTransformer``).
    Returns ``tower_name``. Input (B, 3, H, W) with H, W multiples of ``patch_size``.
    """
    if not isinstance(tower_name, str) or not tower_name.isidentifier():
        raise ValueError(f"tower_name must be a Python identifier, got {tower_name!r}")
    normalize_schemes(pos_embed, pos_embed_kwargs, OPEN_CLIP_ENTRY)  # fail now, not when open_clip builds it
    for key, value in (
        ("img_size", img_size),
        ("patch_size", patch_size),
        ("embed_dim", embed_dim),
        ("depth", depth),
        ("num_heads", num_heads),
    ):
        check_int(value, key, min=1)
    unknown = sorted(set(vit_kwargs) - _VIT_ARGUMENTS)
    if unknown:
        raise ArgumentTypeError(
            f"vit_kwargs must be arguments of VisionPEViT (timm's VisionTransformer), got unknown {unknown}"
        )
    if img_size % patch_size:
        raise ValueError(f"img_size={img_size} must be divisible by patch_size={patch_size}")
    defaults = dict(
        pos_embed=pos_embed,
        pos_embed_kwargs=pos_embed_kwargs,
        img_size=img_size,
        patch_size=patch_size,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        dynamic_img_size=True,
        **vit_kwargs,
    )
    check_vit_args({k: v for k, v in defaults.items() if k not in ("pos_embed", "pos_embed_kwargs")})
    pretrained_cfg = {
        "num_classes": 0,
        "input_size": (3, img_size, img_size),
        "pool_size": None,
        "fixed_input_size": False,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> VisionPEViT:
        if pretrained:
            raise ValueError(f"{tower_name} has no pretrained weights; use timm_model_pretrained=False")
        # timm's factory passes its pretrained-config plumbing along; this tower has a fixed config.
        cfg = dict(pretrained_cfg)
        for key in ("pretrained_cfg", "pretrained_cfg_overlay"):
            extra = kwargs.pop(key, None)
            cfg.update(extra if isinstance(extra, dict) else {})
        kwargs.pop("cache_dir", None)
        args = {**defaults, **kwargs}
        features = feature_cfg(args)
        return build_model_with_cfg(OpenCLIPTower, tower_name, False, pretrained_cfg=cfg, feature_cfg=features, **args)

    entrypoint.__name__ = entrypoint.__qualname__ = tower_name
    entrypoint.__module__ = _TOWERS.__name__
    setattr(_TOWERS, tower_name, entrypoint)
    register_model(entrypoint)
    return tower_name


def register_open_clip_model(
    name: str,
    *,
    pos_embed: str | Sequence[str],
    embed_dim: int = 512,
    vision: dict[str, Any] | None = None,
    text_cfg: dict[str, Any] | None = None,
    timm_pool: str = "avg",
    config_dir: str | Path | None = None,
) -> str:
    """Register an open_clip model ``name`` whose vision tower is a visionpe ViT with ``pos_embed``.

    Args:
        name: the open_clip model name to register (``open_clip.create_model(name)`` afterwards).
        pos_embed: visionpe vision scheme(s), e.g. ``"rope_mixed"`` or ``["learned", "rope_axial"]``.
        embed_dim: CLIP joint embedding width.
        vision: :func:`register_visionpe_tower` options (``img_size``, ``embed_dim``, ``depth``...).
        text_cfg: open_clip text tower config (``context_length``, ``vocab_size``, ``width``, ``heads``,
            ``layers``); open_clip's defaults where omitted.
        timm_pool: ``"avg"`` or ``"token"`` pooling of the ViT tokens before the projection.
        config_dir: where to write the open_clip JSON config (a temporary directory by default).

    Returns:
        ``name``.

    Raises:
        ValueError: on bad options, a ``text_cfg`` key that open_clip's ``CLIPTextCfg`` lacks, or a ``name`` whose
            timm tower name (``visionpe_clip_`` + ``name`` with non-alphanumerics as ``_``) is already taken by
            another open_clip name (e.g. ``"clip-x"`` after ``"clip_x"``); re-registering the same name replaces it.
        TypeError: ``vision`` or ``text_cfg`` not a dict, or a ``text_cfg`` value of the wrong type.

    Example:
        >>> import open_clip, torch
        >>> from visionpe.integrations.open_clip import register_open_clip_model
        >>> name = register_open_clip_model(
        ...     "visionpe-doc-clip", pos_embed="rope_mixed", embed_dim=16,
        ...     vision=dict(img_size=32, embed_dim=32, depth=1, num_heads=2),
        ...     text_cfg=dict(context_length=8, vocab_size=64, width=16, heads=2, layers=1))
        >>> model = open_clip.create_model(name)
        >>> model.encode_image(torch.randn(1, 3, 64, 64)).shape
        torch.Size([1, 16])
    """
    global _CONFIG_DIR
    import open_clip

    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name must be a non-empty model name without '/', got {name!r}")
    if isinstance(embed_dim, bool) or not isinstance(embed_dim, int) or embed_dim <= 0:
        raise ValueError(f"embed_dim must be a positive int, got {embed_dim!r}")
    if timm_pool not in ("avg", "token"):
        raise ValueError(f"timm_pool must be 'avg' or 'token', got {timm_pool!r}")
    for arg, value in (("vision", vision), ("text_cfg", text_cfg)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{arg} must be a dict or None, got {type(value).__name__}")
    text_cfg = _check_text_cfg(text_cfg or {})
    vision = dict(vision or {})
    if "pos_embed" in vision:
        raise ValueError("pass the vision scheme as pos_embed=..., not inside vision")
    tower = "visionpe_clip_" + "".join(c if c.isalnum() else "_" for c in name)
    owner = _TOWER_OWNERS.get(tower)
    if owner is not None and owner != name:
        raise ValueError(
            f"open_clip model name {name!r} maps to the timm tower {tower!r}, already registered for the open_clip "
            f"model {owner!r}; choose a name that differs from {owner!r} in more than punctuation"
        )
    if owner is None and is_model(tower):
        raise ValueError(f"open_clip model name {name!r} maps to the timm tower {tower!r}, which timm already has")
    register_visionpe_tower(tower, pos_embed=pos_embed, **vision)
    _TOWER_OWNERS[tower] = name
    config = {
        "embed_dim": embed_dim,
        "vision_cfg": {
            "timm_model_name": tower,
            "timm_model_pretrained": False,
            "timm_pool": timm_pool,
            "timm_proj": "linear",
            "image_size": vision.get("img_size", 224),
        },
        "text_cfg": text_cfg,
    }
    if config_dir is None:
        if _CONFIG_DIR is None:
            _CONFIG_DIR = Path(tempfile.mkdtemp(prefix="visionpe_open_clip_"))
        config_dir = _CONFIG_DIR
    path = Path(config_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    open_clip.add_model_config(path)
    return name


def _check_text_cfg(text_cfg: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``text_cfg`` checked against open_clip's ``CLIPTextCfg``: known fields, values of the field's type
    (sizes positive), JSON-serialisable. ValueError on an unknown key or a bad value, TypeError on a wrong type."""
    from open_clip.model import CLIPTextCfg

    fields = {f.name: f for f in dataclasses.fields(CLIPTextCfg)}
    hints = typing.get_type_hints(CLIPTextCfg)
    for key, value in text_cfg.items():
        if key not in fields:
            raise ValueError(f"text_cfg has unknown key {key!r}; open_clip's CLIPTextCfg takes {sorted(fields)}")
        types_ = (hints[key], *typing.get_args(hints[key]))
        if value is None and (fields[key].default is None or type(None) in types_):
            continue
        kind = next((t for t in (bool, int, float, str, dict) if t in types_), None)
        if kind is None:
            continue
        accepted = (int, float) if kind is float else kind
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            raise TypeError(f"text_cfg[{key!r}] must be {kind.__name__}, got {type(value).__name__} {value!r}")
        if key in _POSITIVE_TEXT_SIZES and value <= 0:
            raise ValueError(f"text_cfg[{key!r}] must be positive, got {value!r}")
    try:
        json.dumps(text_cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"text_cfg must be JSON-serialisable (it is written to the model config): {e}") from e
    return dict(text_cfg)
