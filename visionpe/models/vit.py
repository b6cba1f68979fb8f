"""A timm VisionTransformer whose position encoding is chosen by name.

``VisionPEViT`` subclasses timm's ``VisionTransformer`` (patch embed, prefix tokens, pooling, head, init and
``set_input_size`` all come from timm) and replaces only what position encodings touch: the absolute table,
the blocks (so that each receives a :class:`~visionpe.attention.PositionContext`) and ``forward_features``.
"""

from __future__ import annotations

import inspect
import numbers
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from timm.layers import PatchDropoutWithIndices
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..attention import PosBlock, PositionContext
from ..base import AbsolutePositionEncoding, set_coord_augment
from ..checks import ArgumentTypeError, check_bool, check_choice, check_float, check_int, describe
from ..contract import (
    EntryPoint,
    check_built_scheme,
    check_causal,
    check_mixed_resolution,
    check_schemes,
    register_entry_point,
)
from ..grid import CoordAugment, MixedGrid
from ..registry import create_pos_embed, get_scheme_class, scheme_options
from .context import build_position_context
from .naflex import apply_per_grid, build_mixed_position_context, embed_patches, naflex_inputs, pool_valid

__all__ = [
    "VIT_ENTRY",
    "VisionPEViT",
    "build_position_context",
    "create_model_scheme",
    "normalize_schemes",
    "schemes_no_weight_decay",
    "check_img_size",
    "check_vit_args",
]


#: ``timm.create_model("visionpe_vit_*", pos_embed=...)`` (:class:`VisionPEViT`): one image grid, depth maps for the
#: schemes that read them, the input image for absolute schemes that read it, causal attention and mixed-resolution
#: batches
VIT_ENTRY = register_entry_point(
    EntryPoint(
        name='timm.create_model("visionpe_vit_*")',
        argument="pos_embed",
        kinds=("absolute", "rotary", "bias"),
        provides=frozenset({"patch_depth", "pixels"}),
        causal=True,
        mixed_resolution=True,
        label="`visionpe_vit_*`",
    )
)


def normalize_schemes(
    pos_embed: str | Sequence[str], pos_embed_kwargs: dict[str, Any] | None, entry: EntryPoint | None = None
) -> dict[str, dict[str, Any]]:
    """``pos_embed`` and ``pos_embed_kwargs`` as {scheme name: its options}, validated.

    ``pos_embed_kwargs`` is either keyed by scheme name or, for a single scheme, the options themselves. With
    ``entry``, every scheme is checked against what that entry point provides (:func:`~visionpe.contract.check_schemes`)
    and messages name the entry point's argument (``camera_embed`` for the cameras of a multi-view model); without
    it, names only have to be registered.
    """
    arg = entry.argument if entry is not None else "pos_embed"
    names = [pos_embed] if isinstance(pos_embed, str) else list(pos_embed) if isinstance(pos_embed, Sequence) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{arg} must be a scheme name or a non-empty list of names, got {pos_embed!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{arg} lists a scheme twice: {names}")
    if entry is not None:
        check_schemes(entry, names)
    for name in names:
        get_scheme_class(name)  # raises on unknown names, listing the valid ones
    if not isinstance(pos_embed_kwargs or {}, dict):
        raise TypeError(f"{arg}_kwargs must be a dict, got {type(pos_embed_kwargs).__name__}")
    kwargs = dict(pos_embed_kwargs or {})
    if not kwargs or all(k in names for k in kwargs):
        per_scheme = kwargs
    elif len(names) == 1:
        per_scheme = {names[0]: kwargs}
    else:
        raise ValueError(
            f"with several schemes {names}, {arg}_kwargs must be keyed by scheme name, got keys {list(kwargs)}"
        )
    for name, opts in per_scheme.items():
        if not isinstance(opts, dict):
            raise TypeError(f"{arg}_kwargs[{name!r}] must be a dict, got {type(opts).__name__}")
    return {name: dict(per_scheme.get(name, {})) for name in names}


def _size_pair(value: Any, name: str) -> tuple[int, int]:
    """``value`` (an int, or an (H, W) pair of ints of any integer type) as a pair of positive Python ints."""
    expected = "a positive int or (H, W) pair of positive ints"
    pair = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pair):
        raise ArgumentTypeError(f"{name} must be {expected}, got {describe(value)}")
    if len(pair) != 2 or min(pair) <= 0:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(pair[0]), int(pair[1])


def check_img_size(img_size: Any, patch_size: Any, dynamic_img_pad: bool = False) -> None:
    """ValueError unless ``img_size`` is positive ints divisible by ``patch_size`` (or ``dynamic_img_pad`` pads);
    TypeError (also a ValueError, :class:`~visionpe.checks.ArgumentTypeError`) when either is not an int or a pair.

    Without padding, a size that is not a multiple of the patch would silently drop the last pixel rows or columns.
    """
    patches = _size_pair(patch_size, "patch_size")
    if img_size is None:  # timm allows it for fully dynamic models
        return
    sizes = _size_pair(img_size, "img_size")
    if not dynamic_img_pad and (sizes[0] % patches[0] or sizes[1] % patches[1]):
        raise ValueError(
            f"img_size {tuple(sizes)} is not divisible by the patch size {tuple(patches)}: the last pixel rows or "
            "columns would be dropped; choose a multiple of the patch size or create the model with "
            "dynamic_img_pad=True"
        )


def _timm_vit_defaults() -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """The defaults of timm's ``VisionTransformer`` arguments, and the choices of those annotated as a Literal."""
    params = inspect.signature(VisionTransformer.__init__).parameters
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    hints = typing.get_type_hints(VisionTransformer.__init__)
    choices = {k: typing.get_args(t) for k, t in hints.items() if typing.get_origin(t) is typing.Literal}
    return defaults, choices


_VIT_DEFAULTS, _VIT_CHOICES = _timm_vit_defaults()
_VIT_POSITIVE_INTS = ("embed_dim", "depth", "num_heads", "in_chans")
_VIT_BOOLS = ("class_token", "no_embed_class", "dynamic_img_size", "dynamic_img_pad")
_VIT_DROP_RATES = ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate")


def check_vit_args(kwargs: Mapping[str, Any]) -> None:
    """Check the timm ``VisionTransformer`` arguments among ``kwargs`` (the others take timm's defaults) before timm's
    constructor runs, where a bad one surfaces as an IndexError (``depth=0``), a ZeroDivisionError
    (``patch_size=0``), a bare AssertionError (``embed_dim`` not divisible by ``num_heads``) or a model that cannot
    run (``in_chans=0``). Raises ValueError, or TypeError for a wrong type (:class:`~visionpe.checks.ArgumentTypeError`,
    also a ValueError), naming the argument.

    Example:
        >>> check_vit_args({"embed_dim": 100, "num_heads": 3})
        Traceback (most recent call last):
        ...
        ValueError: embed_dim must be divisible by num_heads, got embed_dim=100 and num_heads=3
    """
    args = {**_VIT_DEFAULTS, **kwargs}
    for name in _VIT_POSITIVE_INTS:
        check_int(args[name], name, min=1)
    if args["embed_dim"] % args["num_heads"]:
        raise ValueError(
            f"embed_dim must be divisible by num_heads, got embed_dim={args['embed_dim']} and "
            f"num_heads={args['num_heads']}"
        )
    check_int(args["num_classes"], "num_classes", min=0, expected="a non-negative int (0: no head)")
    check_int(args["reg_tokens"], "reg_tokens", min=0)
    check_float(args["mlp_ratio"], "mlp_ratio", min=0, min_open=True)
    for name in _VIT_BOOLS:
        check_bool(args[name], name)
    for name in _VIT_DROP_RATES:
        check_float(args[name], name, min=0, max=1)
    check_float(args["patch_drop_rate"], "patch_drop_rate", min=0, max=1, max_open=True)
    if args["init_values"] is not None:
        check_float(args["init_values"], "init_values", expected="None or a finite number")
    for name, choices in _VIT_CHOICES.items():
        check_choice(args[name], name, choices)
    if args["global_pool"] == "token" and not args["class_token"]:
        raise ValueError(
            "class_token must be True for global_pool='token' (it pools the class token; or choose another "
            "global_pool, e.g. 'avg'), got class_token=False"
        )
    check_img_size(args["img_size"], args["patch_size"], args["dynamic_img_pad"])


def _autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (False for device types autocast does not know)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # e.g. "meta"
        return False


def _check_batch(x: torch.Tensor, layout: str, channels: int, dtype: torch.dtype | None = None) -> None:
    """Type, rank, dtype, batch size and channels of an input batch laid out as ``layout`` (e.g. "B, C, H, W").

    ``dtype``: the model's (its patch embedding's weights); another floating dtype is refused, except under
    ``torch.autocast``, whose layers cast the input themselves (:func:`_check_dtype`)."""
    dims = layout.split(", ")
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"x must be a batch ({layout}) as a torch.Tensor, got {describe(x)}")
    if x.ndim != len(dims):
        raise ValueError(f"x must be a batch ({layout}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point batch ({layout}), got dtype {x.dtype}")
    c = dims.index("C")
    if x.shape[0] == 0 or x.shape[c] != channels or min(x.shape[1:]) == 0:
        hint = ""
        if x.shape[-1] == channels and x.shape[c] != channels:  # channels last: C moved behind the spatial sizes
            order = (*range(c), x.ndim - 1, *range(c, x.ndim - 1))
            hint = f" (channels last? x.permute{order} gives ({layout}))"
        raise ValueError(
            f"x must be a non-empty batch ({layout}) with B >= 1, C = {channels} and sizes >= 1, got "
            f"{tuple(x.shape)}{hint}"
        )
    if dtype is not None:
        _check_dtype(x, "x", dtype)


def _check_dtype(x: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """ValueError unless the floating-point input ``x`` has the model's ``dtype``, or runs under ``torch.autocast``
    in a dtype autocast casts (float32, float16, bfloat16; it leaves float64 as it is); without the check torch stops
    at the first layer ("Input type (double) and bias type (float) should be the same")."""
    if x.dtype != dtype and (x.dtype == torch.float64 or not _autocast_enabled(x.device.type)):
        raise ValueError(
            f"{name} must have the model's dtype {dtype} (or, under torch.autocast, float32, float16 or bfloat16), "
            f"got dtype {x.dtype}; convert it with {name}.to({dtype})"
        )


def _feature_indices(indices: Any, num_blocks: int) -> tuple[list[int], int]:
    """timm's ``feature_take_indices`` (the blocks whose outputs ``forward_intermediates`` returns, and the last one
    to run) after checking ``indices``: None (every block), n (the last n blocks) or a non-empty list of block
    indices (negative from the end); timm would stop at a bare AssertionError."""
    if isinstance(indices, (list, tuple)):
        if not indices:
            raise ValueError(f"indices must name at least one block (of {num_blocks}), got {indices!r}")
        for i, index in enumerate(indices):
            check_int(index, f"indices[{i}]", min=-num_blocks, max=num_blocks - 1)
    elif indices is not None:
        phrase = f"None, a number of last blocks in [1, {num_blocks}] or a list of block indices"
        check_int(indices, "indices", min=1, max=num_blocks, expected=phrase)
    return feature_take_indices(num_blocks, indices)


def _check_images(
    x: torch.Tensor,
    channels: int,
    img_size: tuple[int, int] | None,
    patch_size: tuple[int, int],
    dynamic_img_size: bool,
    dynamic_img_pad: bool,
    dtype: torch.dtype | None = None,
    layout: str = "B, C, H, W",
) -> None:
    """A (B, C, H, W) batch the model takes (``layout`` for other layouts ending in C, H, W, e.g. views): ``img_size``
    unless ``dynamic_img_size``, else any size divisible by the patch (any size with ``dynamic_img_pad``); ``dtype``
    as :func:`_check_batch`."""
    _check_batch(x, layout, channels, dtype)
    height, width = x.shape[-2:]
    ph, pw = patch_size
    if dynamic_img_size:
        if not dynamic_img_pad and (height % ph or width % pw):
            raise ValueError(
                f"x has image size {height}x{width}, not divisible by the patch size {ph}x{pw}; "
                "resize it or create the model with dynamic_img_pad=True"
            )
    elif (height, width) != img_size:
        raise ValueError(
            f"x has image size {height}x{width}, which does not match the model's img_size "
            f"{img_size}; create it with dynamic_img_size=True or call set_input_size()"
        )


@torch.fx.wrap
def _traced_input(
    x: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    depth: torch.Tensor | None,
    channels: int,
    img_size: tuple[int, int] | None,
    patch_size: tuple[int, int],
    dynamic_img_size: bool,
    dynamic_img_pad: bool,
) -> torch.Tensor:
    """``x`` after the input checks, as a leaf of a ``torch.fx`` graph (``torch.fx.wrap``, as timm wraps its
    position-embedding functions): symbolic tracing records this call instead of tracing the checks, so the traced
    model (torchvision's ``create_feature_extractor``, timm's ``features_only`` fx path) checks every batch as the
    eager one does. Position states are traced for the model's fixed grid, without an attention mask, causal
    attention or depth, so the graph refuses those at run time rather than ignoring them."""
    if attn_mask is not None or is_causal is not False or depth is not None:
        raise ValueError(
            "this torch.fx-traced model was traced without attn_mask, is_causal and depth; trace the eager model "
            "with concrete_args for them, or call the eager model"
        )
    _check_images(x, channels, img_size, patch_size, dynamic_img_size, dynamic_img_pad)
    return x


@torch.fx.wrap
def _add_absolute(
    scheme: AbsolutePositionEncoding,
    x: torch.Tensor,
    grid_size: tuple[int, ...],
    num_prefix_tokens: int,
    after_block: int | None = None,
    pixels: torch.Tensor | None = None,
) -> torch.Tensor:
    """An absolute scheme applied to the tokens ``x`` (after block ``after_block`` for CPE's PEGs), one leaf call of
    a ``torch.fx`` graph (as :func:`~visionpe.attention.position_attention`): schemes check their tokens and
    resample tables with Python control flow. A scheme that requires ``"pixels"`` gets the input images."""
    extra = {} if after_block is None else {"after_block": after_block}
    if "pixels" in getattr(scheme, "requires", ()):
        extra["pixels"] = pixels
    return scheme(x, grid_size, num_prefix_tokens, **extra)


@torch.fx.wrap
def _traced_position_context(
    schemes: nn.ModuleDict, num_prefix_tokens: int, grid_size: tuple[int, ...], x: torch.Tensor
) -> PositionContext:
    """:func:`build_position_context` on ``x``'s device as one leaf of a ``torch.fx`` graph: the states are built
    with Python control flow (grid sizes, caches, per-layer tables), so the graph calls this and hands the context
    to the attention, a leaf call as well (:func:`~visionpe.attention.position_attention`)."""
    return build_position_context(schemes.values(), num_prefix_tokens, grid_size, x.device)


def schemes_no_weight_decay(pos_schemes: nn.ModuleDict) -> set[str]:
    """The position parameters of a model's ``pos_schemes`` kept out of weight decay, as state-dict names: what
    each scheme's ``no_weight_decay`` lists, and an absolute scheme's table ``pos_embed`` (as timm's)."""
    skip = set()
    for name, scheme in pos_schemes.items():
        if hasattr(scheme, "no_weight_decay"):
            skip |= {f"pos_schemes.{name}.{p}" for p in scheme.no_weight_decay()}
        if isinstance(scheme, AbsolutePositionEncoding) and hasattr(scheme, "pos_embed"):
            skip.add(f"pos_schemes.{name}.pos_embed")
    return skip


def create_model_scheme(model: nn.Module, name: str, options: dict[str, Any]) -> nn.Module:
    """Scheme ``name`` built for a timm ViT-like ``model`` (``blocks``, ``patch_embed``, ``embed_dim``,
    ``num_prefix_tokens``, ``no_embed_class``; or timm's NaFlexVit, whose grid is its ``embeds.pos_embed_grid_size``
    and whose learned table has no prefix rows): its width, heads and depth, and, for every scheme that takes them and
    where ``options`` does not set them, the model's grid, prefix-token count, grid rank and ``no_embed_class``
    (DeiT III and register ViTs: the learned table has no rows for prefix tokens; the other schemes never add an
    absolute embedding to prefix tokens)."""
    embeds = getattr(model, "embeds", None)
    if embeds is not None and getattr(model, "patch_embed", None) is None:
        # timm's NaFlexVit: the grid of its learned table (or of its default image size); no table rows for prefix
        # tokens (NaFlex adds its table to the patches only)
        grid_size = embeds.pos_embed_grid_size
        if grid_size is None:
            raise ValueError(
                f"{type(model).__name__} has neither pos_embed_grid_size nor img_size, so no reference grid for "
                f"{name!r}; create it with pos_embed_grid_size=(H, W) or img_size"
            )
        grid_size, no_embed_class = tuple(int(n) for n in grid_size), True
    else:
        grid_size, no_embed_class = tuple(model.patch_embed.grid_size), bool(model.no_embed_class)
    context = {
        "grid_size": grid_size,
        "num_prefix_tokens": model.num_prefix_tokens,
        "ndim": len(grid_size),
        "no_embed_class": no_embed_class,
    }
    embed = getattr(model, "patch_embed", None)
    if embed is not None:  # for a scheme that reads the image (LOOPE's context network)
        context["patch_size"] = tuple(embed.patch_size)
        context["in_chans"] = embed.proj.in_channels
    given = options.get("num_prefix_tokens", model.num_prefix_tokens)
    if given != model.num_prefix_tokens:  # the scheme would refuse every batch of this model
        raise ValueError(
            f"pos_embed_kwargs[{name!r}]['num_prefix_tokens'] must be the model's prefix-token count "
            f"{model.num_prefix_tokens} (class token and registers), got {given!r}"
        )
    takes = scheme_options(get_scheme_class(name))
    extra = {k: v for k, v in context.items() if k in takes and k not in options}
    depth, num_heads = len(model.blocks), model.blocks[0].attn.num_heads
    return create_pos_embed(name, dim=model.embed_dim, num_heads=num_heads, depth=depth, **extra, **options)


class VisionPEViT(VisionTransformer):
    """timm ViT with pluggable position encodings.

    Args:
        pos_embed: scheme name or list of names (``["learned", "rope_mixed"]`` is rope-vit's Mixed + APE).
        pos_embed_kwargs: options per scheme, ``{"rope_axial": {"base": 100}}`` (or flat for one scheme).
        coord_augment: a training-time coordinate augmentation (:class:`~visionpe.grid.CoordAugment`, or a dict of
            its fields) for every scheme that reads coordinates (:func:`~visionpe.base.set_coord_augment`); None
            (default) keeps each scheme's own (none, except ``rope_dinov3``'s rescale).
        **kwargs: timm ``VisionTransformer`` arguments (``img_size``, ``dynamic_img_size``, ``class_token``...).
            ``no_embed_class`` (DeiT III, register ViTs) goes to the ``learned`` table, as in timm.

    Input ``(B, 3, H, W)`` -> logits ``(B, num_classes)``, or a mixed-resolution batch in timm's NaFlex layout: the
    dict of timm's ``NaFlexCollator`` (``patches`` (B, N, P*P*C) with each patch flattened as (P, P, C),
    ``patch_coord``, ``patch_valid``) or the three tensors (``model(patches, patch_coord=..., patch_valid=...)``), as
    timm's ``NaFlexVit`` takes it (:mod:`visionpe.models.naflex`); each image is encoded at its own grid and pooled
    over its valid tokens, so its logits are those of the image alone. ``group_matcher`` puts position parameters in the
    stem group (timm's layer-wise lr decay, open_clip's ``lock_image_tower``), ``forward_intermediates`` is timm's.
    """

    #: the layout of each flattened patch of a NaFlex batch: (P, P, C) (timm's default) or, False, (C, P, P)
    naflex_channels_last: bool = True
    #: what this model provides its schemes (:mod:`visionpe.contract`): the schemes it accepts are checked against it
    entry_point: ClassVar[EntryPoint] = VIT_ENTRY

    def __init__(
        self,
        pos_embed: str | Sequence[str] = "learned",
        pos_embed_kwargs: dict[str, Any] | None = None,
        coord_augment: CoordAugment | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        check_vit_args(kwargs)
        schemes = normalize_schemes(pos_embed, pos_embed_kwargs, self.entry_point)
        coord_augment = CoordAugment.from_value(coord_augment)
        patch_drop = kwargs.get("patch_drop_rate", 0.0) > 0
        for key in ("block_fn", "attn_layer"):
            if key in kwargs:
                raise ValueError(f"{key} is set by VisionPEViT, got {key}={kwargs[key]!r}")
        no_embed_class = kwargs.get("no_embed_class")  # None: not given
        for name, opts in schemes.items():
            if no_embed_class is not None and opts.get("no_embed_class", no_embed_class) != no_embed_class:
                raise ValueError(
                    f"no_embed_class={no_embed_class!r} contradicts "
                    f"pos_embed_kwargs[{name!r}]['no_embed_class']={opts['no_embed_class']!r}"
                )
        super().__init__(pos_embed="none", block_fn=PosBlock, **kwargs)
        check_img_size(self.patch_embed.img_size, self.patch_embed.patch_size, self.patch_embed.dynamic_img_pad)
        self.pos_schemes = nn.ModuleDict()
        for name, opts in schemes.items():
            self.pos_schemes[name] = create_model_scheme(self, name, opts)
            check_built_scheme(self.entry_point, name, self.pos_schemes[name])
            after = self.pos_schemes[name].insert_after
            if patch_drop and after:
                # applied between blocks, to the token grid that patch dropout has already thinned (CPE's conv)
                raise ValueError(
                    f"patch_drop_rate > 0 needs every patch on the grid after the embedding, but {name!r} runs "
                    f"after blocks {after}; got patch_drop_rate={kwargs['patch_drop_rate']}"
                )
        self.pos_embed_names = list(schemes)
        if coord_augment is not None:
            set_coord_augment(self, coord_augment)
        if patch_drop:
            # timm's patch dropout, returning the kept indices: rotary and bias states are gathered with them
            self.patch_drop = PatchDropoutWithIndices(
                kwargs["patch_drop_rate"], num_prefix_tokens=self.num_prefix_tokens
            )
        if no_embed_class is None and any(m.no_embed_class for m in self.pos_schemes.values()):
            self.no_embed_class = True  # set through pos_embed_kwargs: keep timm's attribute in step

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for timm's layer-wise lr decay and open_clip's ``lock_image_tower(unlocked_groups=n)``.

        As timm's ViT: group 0 is the stem (patch embedding, prefix tokens, ``norm_pre``), then one group per block,
        the last block sharing its group with the final ``norm``; the head (when there is one) comes last.
        Position parameters go with the stem, as timm's ``pos_embed`` does: learned and Fourier tables, rotary
        frequencies and bias tables act on every block, and schemes with per-layer values hold all layers in one
        tensor (e.g. ``rope_mixed.freqs`` of shape (depth, ...)), which cannot be split between groups.
        The exception is a module applied after one particular block: CPE's PEG after block ``i``
        (``pos_schemes.cpe.pegs.<j>`` for ``insert_after[j] == i``) goes with block ``i``, whose output it
        convolves, as timm's Twins groups each ``pos_block`` with the block it follows.
        """
        after_block = self._position_modules_after_blocks()
        per_block = "|".join(re.escape(prefix) for prefix in after_block)
        not_per_block = rf"(?!(?:{per_block})(?:\.|$))" if per_block else ""
        return dict(
            stem=rf"^{not_per_block}(?:cls_token|reg_token|pos_embed|patch_embed|norm_pre|pos_schemes(?:\.|$))",
            blocks=[
                *((rf"^{re.escape(prefix)}(?:\.|$)", (block,)) for prefix, block in after_block.items()),
                (r"^blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ],
        )

    def _position_modules_after_blocks(self) -> dict[str, int]:
        """{module name: block index} for position modules that run after one block (CPE's PEGs), as each scheme
        declares them (:meth:`~visionpe.base.PositionEncoding.modules_after_blocks`)."""
        return {
            f"pos_schemes.{name}.{module}": block
            for name, scheme in self.pos_schemes.items()
            for module, block in scheme.modules_after_blocks().items()
        }

    # -- position state -------------------------------------------------------------------------------------
    def _schemes(self, kind: str) -> list[nn.Module]:
        return [m for m in self.pos_schemes.values() if m.kind == kind]

    def position_context(
        self, grid_size: tuple[int, ...], device: torch.device, patch_depth: torch.Tensor | None = None
    ) -> PositionContext:
        """Rotary and bias states for ``grid_size``, built once per forward for all blocks; ``patch_depth``
        (B, N), each patch's mean depth, goes to the schemes that declare it among their ``extra_inputs`` (STRING's
        ``depth_coords``)."""
        return build_position_context(self.pos_schemes.values(), self.num_prefix_tokens, grid_size, device, patch_depth)

    def _check_batch(self, x: torch.Tensor, layout: str) -> None:
        """Rank, dtype, batch size and channels of an input batch laid out as ``layout`` (e.g. "B, C, H, W")."""
        _check_batch(x, layout, self.patch_embed.proj.in_channels, self._input_dtype())

    def _input_dtype(self) -> torch.dtype:
        """The dtype the model takes its input in outside ``torch.autocast``: its patch embedding's."""
        return self.patch_embed.proj.weight.dtype

    def _input_options(self) -> tuple[int, tuple[int, int] | None, tuple[int, int], bool, bool]:
        """(channels, img_size, patch_size, dynamic_img_size, dynamic_img_pad): what :func:`_check_images` reads."""
        embed = self.patch_embed
        img_size = None if embed.img_size is None else tuple(embed.img_size)
        return embed.proj.in_channels, img_size, tuple(embed.patch_size), self.dynamic_img_size, embed.dynamic_img_pad

    def _check_input(self, x: torch.Tensor) -> None:
        _check_images(x, *self._input_options(), dtype=self._input_dtype())

    def _grid_size(self, x: torch.Tensor) -> tuple[int, ...]:
        """Grid of the patch embedding's output (NHWC when ``dynamic_img_size``, else NLC on the nominal grid)."""
        return tuple(x.shape[1:3]) if self.dynamic_img_size else tuple(self.patch_embed.grid_size)

    def reset_parameters(self) -> None:
        """Draw the model's own tokens (class and register tokens) as timm's ``init_weights`` does, N(0, 1e-6^2).

        Meta-device initialisation (Lightning's ``ModelParallelStrategy`` and FSDP strategies, torchtitan) calls
        ``reset_parameters`` on every module that holds tensors after ``to_empty``; the blocks, the position schemes
        and the head have their own, so without this one the tokens would keep uninitialised memory."""
        with torch.no_grad():
            for token in (self.cls_token, self.reg_token):
                if token is not None:
                    nn.init.normal_(token, std=1e-6)

    def _pos_embed_grid(
        self, x: torch.Tensor, pixels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Patch tokens -> prefix + patches with absolute encodings, and the grid size; ``pixels``: the images the
        tokens come from, for the schemes that read them (``requires`` ``"pixels"``)."""
        grid_size = self._grid_size(x)
        x = super()._pos_embed(x)  # timm: concatenate prefix tokens (its own table is None)
        for scheme in self._schemes("absolute"):
            if not scheme.insert_after:
                x = _add_absolute(scheme, x, grid_size, self.num_prefix_tokens, pixels=pixels)
        return self.pos_drop(x), grid_size

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        return self._pos_embed_grid(x)[0]

    @property
    def takes_depth(self) -> bool:
        """Whether a position scheme rotates by depth (STRING with ``depth_coords=True``): the forward then needs
        ``depth=`` (B, 1, H, W) or (B, H, W), the depth map of the image."""
        return any("patch_depth" in scheme.extra_inputs for scheme in self.pos_schemes.values())

    def _patch_depth(self, depth: torch.Tensor | None, x: torch.Tensor, grid_size: tuple[int, ...]):
        """(B, N) mean depth of each patch of ``depth`` (B, 1, H, W) or (B, H, W), the depth map of the images x
        (B, C, H, W); None when no scheme takes depth. Patches that dynamic_img_pad cuts short average the
        pixels they have."""
        if not self.takes_depth:
            if depth is not None:
                raise ValueError(
                    "depth= is read by STRING with depth_coords=True only; this model's schemes "
                    f"{self.pos_embed_names} take no depth, got depth of shape {tuple(depth.shape)}"
                )
            return None
        if depth is None:
            raise ValueError(
                "this model rotates by depth (STRING with depth_coords=True): call it with depth=(B, 1, H, W), "
                "the depth map of the images, got depth=None"
            )
        if not isinstance(depth, torch.Tensor) or not depth.is_floating_point():
            raise TypeError(f"depth must be a floating-point tensor, got {getattr(depth, 'dtype', type(depth))}")
        if depth.ndim == 3:
            depth = depth.unsqueeze(1)
        if depth.ndim != 4 or depth.shape[1] != 1 or (depth.shape[0], *depth.shape[2:]) != (x.shape[0], *x.shape[2:]):
            raise ValueError(
                f"depth must be (B, 1, H, W) or (B, H, W) matching the images {tuple(x.shape)}, "
                f"got {tuple(depth.shape)}"
            )
        patch = self.patch_embed.patch_size
        with torch.autocast(depth.device.type, enabled=False):
            pooled = torch.nn.functional.avg_pool2d(depth.float(), patch, patch, ceil_mode=True)
        if tuple(pooled.shape[2:]) != tuple(grid_size):
            raise ValueError(f"depth pools to a {tuple(pooled.shape[2:])} grid, but the patches form {grid_size}")
        return pooled.flatten(1)

    def _blocks(
        self,
        x: torch.Tensor,
        attn_mask=None,
        is_causal: bool = False,
        last: int | None = None,
        depth: torch.Tensor | None = None,
    ):
        """Embed, then yield the tokens after each block (absolute schemes with ``insert_after`` applied)."""
        tracing = isinstance(x, torch.fx.Proxy)
        if tracing:
            # torch.fx symbolic tracing: the checks become one leaf call of the graph and the other inputs take
            # their defaults (position states are built with Python control flow on the grid, which fx fixes)
            if self.dynamic_img_size:
                raise ValueError(
                    "torch.fx tracing builds the position states for one grid: trace a model created without "
                    "dynamic_img_size=True (as for timm's ViT), got dynamic_img_size=True"
                )
            x = _traced_input(x, attn_mask, is_causal, depth, *self._input_options())
            attn_mask, is_causal, depth = None, False, None
        else:
            self._check_input(x)
            if is_causal:
                check_causal(self.entry_point, self.pos_schemes)
        images = x
        x, grid_size = self._pos_embed_grid(self.patch_embed(x), images)
        patch_depth = self._patch_depth(depth, images, grid_size)
        num_tokens = x.shape[1]
        x, keep = (
            self.patch_drop(x) if isinstance(self.patch_drop, PatchDropoutWithIndices) else (self.patch_drop(x), None)
        )
        x = self.norm_pre(x)
        if tracing:  # patch_depth is None: depth is not traced
            ctx = _traced_position_context(self.pos_schemes, self.num_prefix_tokens, grid_size, x)
        else:
            ctx = self.position_context(grid_size, x.device, patch_depth)
        if keep is not None and (ctx.rotary or ctx.bias):
            ctx.keep_tokens(keep, self.num_prefix_tokens, num_tokens)

        def insert(scheme: AbsolutePositionEncoding, tokens: torch.Tensor, i: int) -> torch.Tensor:
            return _add_absolute(scheme, tokens, grid_size, self.num_prefix_tokens, i, images)

        yield from self._run_blocks(x, ctx, last, insert, attn_mask, is_causal)

    def _run_blocks(
        self,
        x: torch.Tensor,
        ctx: PositionContext,
        last: int | None,
        insert: Callable[[AbsolutePositionEncoding, torch.Tensor, int], torch.Tensor],
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ):
        """Yield the tokens after each block (up to block ``last``), each block with the position context ``ctx``;
        ``insert(scheme, tokens, i)`` applies an absolute scheme that runs after block ``i`` (CPE's PEG)."""
        inserts = [m for m in self._schemes("absolute") if m.insert_after]
        blocks = self.blocks if last is None else self.blocks[: last + 1]
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
                x = checkpoint(blk, x, attn_mask, is_causal, ctx, use_reentrant=False)
            else:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal, pos=ctx)
            for scheme in inserts:
                if i in scheme.insert_after:
                    x = insert(scheme, x, i)
            yield x

    def _blocks_naflex(self, patches: torch.Tensor, layout: MixedGrid, last: int | None = None):
        """A mixed-resolution batch: embed each patch, add the absolute schemes per grid, then yield the tokens after
        each block, attention running per grid (:mod:`visionpe.models.naflex`)."""
        embed = self.patch_embed
        x = embed.norm(embed_patches(embed.proj, patches, self.naflex_channels_last))
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)
        for scheme in self._schemes("absolute"):
            if not scheme.insert_after:
                x = apply_per_grid(
                    lambda t, g, s=scheme: s(t, g, self.num_prefix_tokens), x, layout, self.num_prefix_tokens
                )
        x = self.pos_drop(x)
        if self.training and isinstance(self.patch_drop, PatchDropoutWithIndices):
            raise ValueError(
                "patch dropout keeps a subset of each grid, which a mixed-resolution batch does not take in training; "
                f"got patch_drop_rate={self.patch_drop.prob} (call model.eval(), or feed (B, C, H, W) batches)"
            )
        x = self.norm_pre(x)
        ctx = build_mixed_position_context(self.pos_schemes.values(), self.num_prefix_tokens, layout, x.device)

        def insert(scheme: AbsolutePositionEncoding, tokens: torch.Tensor, i: int) -> torch.Tensor:
            def apply(t: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
                return scheme(t, grid, self.num_prefix_tokens, after_block=i)

            return apply_per_grid(apply, tokens, layout, self.num_prefix_tokens)

        yield from self._run_blocks(x, ctx, last, insert)

    def _naflex_batch(
        self,
        x: torch.Tensor | Mapping[str, Any],
        patch_coord: torch.Tensor | None,
        patch_valid: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        depth: torch.Tensor | None,
    ) -> tuple[torch.Tensor, MixedGrid] | None:
        """(patches, layout) of a NaFlex batch (a dict, or patches with patch_coord and patch_valid), else None.

        Under torch.fx symbolic tracing every argument is a Proxy: the image path is traced and the NaFlex inputs
        take their defaults, as the other optional inputs do (:meth:`_blocks`)."""
        if isinstance(x, torch.fx.Proxy):
            return None
        if not isinstance(x, Mapping) and patch_coord is None and patch_valid is None:
            return None
        if not self.entry_point.mixed_resolution:
            raise ValueError(
                f"x is a mixed-resolution batch (a NaFlex dict, or patches with patch_coord and patch_valid), which "
                f"{type(self).__name__} does not take; visionpe_vit_* and apply_position_scheme on a NaFlexVit do"
            )
        check_mixed_resolution(self.entry_point, self.pos_schemes)
        if is_causal or depth is not None:
            raise ValueError(
                "a mixed-resolution batch takes neither is_causal nor depth, got "
                f"is_causal={is_causal}, depth={'a tensor' if depth is not None else None}"
            )
        patches, layout = naflex_inputs(x, patch_coord, patch_valid, attn_mask)
        _check_dtype(patches, "patches", self._input_dtype())
        return patches, layout

    def forward_features(
        self,
        x: torch.Tensor | Mapping[str, Any],
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        depth: torch.Tensor | None = None,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """(B, C, H, W) images -> (B, num_prefix_tokens + N, C) normalised tokens; ``depth`` (B, 1, H, W), the
        images' depth maps, only for STRING with ``depth_coords=True`` (RGB-D positions).

        A mixed-resolution batch (a NaFlex dict, or patches (B, N, P*P*C) with ``patch_coord`` and ``patch_valid``)
        gives, as timm's ``NaFlexVit``, ``{"patches": tokens, "patch_valid": patch_valid}``: the normalised tokens
        (B, num_prefix_tokens + N, C), padding rows included, and the validity mask :meth:`forward_head` pools with.
        """
        naflex = self._naflex_batch(x, patch_coord, patch_valid, attn_mask, is_causal, depth)
        if naflex is not None:
            patches, layout = naflex
            tokens = None
            for tokens in self._blocks_naflex(patches, layout):  # noqa: B007 - the last block's output
                pass
            return {"patches": self.norm(tokens), "patch_valid": layout.patch_valid}
        tokens = x
        for tokens in self._blocks(x, attn_mask, is_causal, depth=depth):  # noqa: B007 - the last block's output
            pass
        return self.norm(tokens)

    def forward_head(
        self, x: torch.Tensor, pre_logits: bool = False, patch_valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """timm's head; with ``patch_valid`` (B, N), pooling over each sample's valid tokens only
        (:func:`~visionpe.models.naflex.pool_valid`, as timm's ``NaFlexVit``)."""
        if patch_valid is None:
            return super().forward_head(x, pre_logits=pre_logits)
        x = self.head_drop(self.fc_norm(pool_valid(self, x, patch_valid)))
        return x if pre_logits else self.head(x)

    def forward(
        self,
        x: torch.Tensor | Mapping[str, Any],
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        depth: torch.Tensor | None = None,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """timm's forward; ``depth`` as in :meth:`forward_features`. A mixed-resolution batch (timm's NaFlex dict, or
        patches with ``patch_coord`` and ``patch_valid``) gives each image's logits at its own grid."""
        features = self.forward_features(
            x, attn_mask=attn_mask, is_causal=is_causal, depth=depth, patch_coord=patch_coord, patch_valid=patch_valid
        )
        if isinstance(features, dict):
            return self.forward_head(features["patches"], patch_valid=features["patch_valid"])
        return self.forward_head(features)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        depth: torch.Tensor | None = None,
    ):
        """timm's feature-extraction API (same signature and outputs as timm 1.0's ``VisionTransformer``).

        ``indices``: last n blocks if int, all if None, else those block indices. Features are (B, C, H, W) with
        ``output_fmt="NCHW"`` or (B, N, C) with ``"NLC"``. Returns (final tokens, [features]), or the features
        alone with ``intermediates_only``; with ``return_prefix_tokens`` (and prefix tokens in the model) each
        feature is (spatial, prefix). With ``output_dict`` a dict: ``image_intermediates``, plus
        ``image_intermediates_prefix`` (with ``return_prefix_tokens``) and ``image_features`` (unless
        ``intermediates_only``). ``depth``: as :meth:`forward_features` (STRING's RGB-D positions), after timm's.
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        if isinstance(x, Mapping):
            raise TypeError(
                "x of forward_intermediates must be (B, C, H, W) images (features on one grid), got a mixed-resolution "
                f"batch (a NaFlex dict, keys {sorted(x)}), which goes through forward or forward_features"
            )
        take_indices, max_index = _feature_indices(indices, len(self.blocks))
        if not isinstance(x, torch.fx.Proxy):
            self._check_input(x)  # before x.shape is read
        batch, _, height, width = x.shape
        feat_h, feat_w = self.patch_embed.dynamic_feat_size((height, width))
        intermediates, prefixes = [], []
        tokens = x
        for i, tokens in enumerate(self._blocks(x, attn_mask, is_causal, max_index if stop_early else None, depth)):
            if i in take_indices:
                y = self.norm(tokens) if norm else tokens
                spatial, prefix = y[:, self.num_prefix_tokens :], y[:, : self.num_prefix_tokens]
                if output_fmt == "NCHW":
                    spatial = spatial.reshape(batch, feat_h, feat_w, -1).permute(0, 3, 1, 2).contiguous()
                intermediates.append(spatial)
                prefixes.append(prefix)
        with_prefix = return_prefix_tokens and self.num_prefix_tokens > 0  # timm: no prefix part without prefixes
        if output_dict:
            out = {"image_intermediates": intermediates}
            if with_prefix:
                out["image_intermediates_prefix"] = prefixes
            if not intermediates_only:
                out["image_features"] = self.norm(tokens)
            return out
        if with_prefix:
            intermediates = list(zip(intermediates, prefixes, strict=True))
        if intermediates_only:
            return intermediates
        return self.norm(tokens), intermediates

    @torch.jit.ignore
    def set_input_size(self, img_size=None, patch_size=None) -> None:
        """timm's ``set_input_size``; learned tables are resampled, rotary tables follow the grid by design."""
        check_img_size(
            self.patch_embed.img_size if img_size is None else img_size,
            self.patch_embed.patch_size if patch_size is None else patch_size,
            self.patch_embed.dynamic_img_pad,
        )
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        for scheme in self.pos_schemes.values():
            scheme.set_grid_size(tuple(self.patch_embed.grid_size))

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set(super().no_weight_decay()) | schemes_no_weight_decay(self.pos_schemes)
