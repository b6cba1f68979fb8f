"""Swap the position encoding of a timm ViT in place, keeping every other weight.

:func:`apply_position_scheme` takes a timm ``VisionTransformer``, ``Eva`` (EVA-02, timm's RoPE ViTs
``vit_*_rope_*``, rope-vit's ports, DINOv3 ``vit_*_dinov3*``, Perception Encoder...) or ``NaFlexVit`` (the
``naflexvit_*`` models, with timm's standard blocks), pretrained or not, and makes
its attention apply visionpe schemes instead of the model's own encoding: rotary schemes rotate q and k, bias
schemes add to the logits (scaled dot-product attention, with the bias as its mask), absolute schemes add to the
tokens. The model's own table (``pos_embed``) and rotary module (``rope``) are removed; patch embedding, prefix
tokens, q/k/v (EVA's separate q and v biases included), q/k norms, MLPs (SwiGLU included), norms and head keep their
weights. The schemes live in ``model.pos_schemes``, as in :class:`~visionpe.models.vit.VisionPEViT`, so
:func:`~visionpe.set_extrapolation`, :func:`~visionpe.base.set_coord_augment` and the other model-level tools
find them.

``pos_embed=None`` translates the model's own encoding (:func:`own_position_scheme`), exactly: timm's learned
table -> ``learned`` (the table copied); EVA's axial RoPE (``rope_type="cat"``) -> ``rope_axial`` with its base
(``rope_temperature``), block order (``axis_order="yx"`` for ``grid_indexing="ij"``, EVA-02) and, with
``ref_feat_shape``, ``coord_mode="ref_scaled"`` on that grid (EVA's i * ref / n), with ``grid_offset`` its
``coord_offset`` (Perception Encoder); rope-vit's Mixed RoPE
(``"mixed"``) -> ``rope_mixed`` (its learned frequencies copied); DINOv3's RoPE (``"dinov3"``) -> ``rope_dinov3``
(periods, coordinate normalisation and augmentation copied); MRoPE (``"mrope"``) -> ``rope_mixed`` holding MRoPE's
fixed frequencies (frozen: ``requires_grad=False``). A scheme named in ``pos_embed`` that the model already has
(its own encoding translated, or a visionpe scheme of a model converted before) starts from the model's values; the
other schemes start at their init. A swap between visionpe schemes thus needs no special case.

Layout [visionpe]: timm rotates pairs of channels either interleaved, (2j, 2j + 1), or "half", (c, c + d/2)
(DINOv3, MRoPE, ``rope_rotate_half=True``); visionpe rotates interleaved pairs. A model with a rotary encoding in the
half layout has the q and k channels of every head relabelled once (:func:`~visionpe.rotary.rope_dinov3.
half_to_interleaved` on the rows of W_q, W_k, their biases and the q/k norm weights), so that the planes the model
rotated stay planes visionpe rotates. The logits q . k are unchanged by a relabelling common to q and k, with any
scheme; the report lists the relabelled keys.

After the swap a ``VisionTransformer`` is a :class:`~visionpe.models.vit.VisionPEViT` (its blocks
:class:`~visionpe.attention.PosBlock`), an ``Eva`` a :class:`VisionPEEva` (its attention modules
:class:`EvaPosAttention` or :class:`RopePosAttention`); both keep timm's forward, ``forward_intermediates``,
``set_input_size`` and state-dict names outside the position keys.

A ``NaFlexVit`` becomes a :class:`VisionPENaFlexVit` (its blocks :class:`~visionpe.attention.PosBlock`): timm's
forward, taking (B, C, H, W) images or a mixed-resolution batch (the dict of timm's ``NaFlexCollator``, or patches
with ``patch_coord`` and ``patch_valid``), with each image's schemes at its own grid (:mod:`visionpe.models.naflex`).
Its own learned table (``pos_embed`` (1, H, W, C), resampled per image with ``pos_embed_interp_mode``,
``pos_embed_antialias``, ``pos_embed_ar_preserving`` and ``pos_embed_align_corners``) translates to ``learned`` on that
grid, without prefix rows (the table copied), and its factorized tables (``pos_embed="factorized"``) to
``learned_factorized``: the logits of a mixed batch are the model's own. timm's grid-sample resampling has no exact
visionpe equivalent (ValueError for ``pos_embed=None``; name the schemes instead).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from timm.layers import Attention, PatchDropout, PatchDropoutWithIndices
from timm.layers import pos_embed_sincos as timm_rope
from timm.layers.attention import AttentionRope
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.naflexvit import NaFlexVit
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..attention import PosAttention, PosBlock, PositionContext
from ..contract import EntryPoint, check_mixed_resolution, register_entry_point
from ..grid import CoordAugment
from ..models.convert import LoadReport
from ..models.naflex import apply_per_grid, build_mixed_position_context, naflex_inputs
from ..models.vit import (
    VisionPEViT,
    _check_dtype,
    _check_images,
    _feature_indices,
    create_model_scheme,
    normalize_schemes,
    schemes_no_weight_decay,
)
from ..rotary.rope_dinov3 import half_to_interleaved

__all__ = [
    "SWAP_ENTRY",
    "apply_position_scheme",
    "own_position_scheme",
    "SwapReport",
    "VisionPEEva",
    "VisionPENaFlexVit",
    "EvaPosAttention",
    "RopePosAttention",
    "SUPPORTED_MODELS",
    "TIMM_FAMILIES",
    "TimmFamily",
    "find_timm_family",
]

#: :func:`apply_position_scheme` on a timm ViT, Eva or NaFlexVit: one image grid, mixed-resolution batches through
#: NaFlexVit; the timm forwards pass no depth maps
SWAP_ENTRY = register_entry_point(
    EntryPoint(
        name="visionpe.integrations.timm.apply_position_scheme",
        argument="pos_embed",
        kinds=("absolute", "rotary", "bias"),
        mixed_resolution=True,
        label="`apply_position_scheme`",
    )
)


@dataclass
class SwapReport(LoadReport):
    """What :func:`apply_position_scheme` did to the model's state dict.

    ``added``: position keys that start at their scheme's init; ``dropped``: keys removed (the model's own table,
    its rotary module's parameters, the previous schemes'); ``copied``: position keys that took the model's values
    (its own encoding translated, or a scheme it already had); ``permuted``: q/k keys whose channels were relabelled
    from the half rotary layout to interleaved pairs (see the module docstring). ``resampled`` stays empty.
    """

    copied: list[str] = field(default_factory=list)
    permuted: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"added (kept init): {self.added}\ndropped: {self.dropped}\ncopied from the model: {self.copied}\n"
            f"q/k channels relabelled (half -> interleaved pairs): {self.permuted}"
        )


# -- attention -------------------------------------------------------------------------------------------------


class _PositionAttention:
    """The forward of :class:`~visionpe.attention.PosAttention` on the projections of timm's EVA attention modules.

    Blocks call ``attn(x, rope=..., attn_mask=..., is_causal=...)``; after the swap the model passes its
    :class:`~visionpe.attention.PositionContext` as ``rope``. q and k are projected and normalised as timm does
    (EVA's q/k/v biases, separate or fused projections, grouped k/v heads repeated to every query head), then rotated
    by the rotary schemes (prefix tokens unrotated), and attention runs through visionpe's bias and SDPA path
    (chunked bias rows, q/k augmentation, patch dropout's kept tokens), shared with ``PosAttention``.
    """

    layer: int = 0
    bias_chunk_bytes = PosAttention.bias_chunk_bytes
    query_chunk_rows = PosAttention.query_chunk_rows
    attn_backend = PosAttention.attn_backend
    _attend_chunked = PosAttention._attend_chunked
    _fused_terms = PosAttention._fused_terms
    _attend = PosAttention._attend

    def forward(
        self,
        x: torch.Tensor,
        rope: PositionContext | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if rope is not None and not isinstance(rope, PositionContext):
            raise TypeError(
                f"{type(self).__name__} takes the model's PositionContext as rope= (its timm rotary tables were "
                f"replaced by visionpe schemes), got {type(rope).__name__}"
            )
        pos = PositionContext() if rope is None else rope
        B, N, _ = x.shape
        gate = getattr(self, "gate", None)
        gate = gate(x).sigmoid() if gate is not None else None
        q, k, v = self._project(x)
        rotation = pos.rotation(self.layer)
        if pos.rotary:
            q, k = rotation.rotate_tokens(torch.stack((q, k)), pos.keep).unbind(0)
            v = rotation.rotate_values(v, pos.keep)
        layers = pos.bias_layers(self.layer, x)
        for layer in layers:
            q, k = layer.augment_qk(q, k)
        out = self._attend_chunked(q, k, v, pos, layers, attn_mask, is_causal)
        if pos.rotary:
            out = rotation.unrotate_output(out, pos.keep)
        out = self.norm(out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, num_heads, N, head_dim) as timm computes them, q and k normalised, k/v heads repeated."""
        B, N, _ = x.shape
        if self.qkv is not None:
            q_bias = getattr(self, "q_bias", None)
            if q_bias is None:  # AttentionRope keeps its bias in the Linear; EVA without qkv_bias has none
                qkv = self.qkv(x)
            else:  # EVA: learned q and v biases, a zero k bias
                bias = torch.cat((q_bias, self.k_bias, self.v_bias))
                qkv = self.qkv(x) + bias if self.qkv_bias_separate else F.linear(x, self.qkv.weight, bias)
            q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            kv_heads = getattr(self, "num_kv_heads", self.num_heads)
            q = self.q_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        groups = self.num_heads // k.shape[1]
        if groups > 1:  # grouped-query attention: head h reads k/v head h // groups, as timm
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v


class EvaPosAttention(_PositionAttention, EvaAttention):
    """timm's ``EvaAttention`` (same parameters and state-dict names) applying visionpe schemes; made in place by
    :func:`apply_position_scheme`."""


class RopePosAttention(_PositionAttention, AttentionRope):
    """timm's ``AttentionRope`` (rope-vit and Perception Encoder ports; same parameters and state-dict names)
    applying visionpe schemes; made in place by :func:`apply_position_scheme`."""


_POS_ATTENTION = {EvaAttention: EvaPosAttention, AttentionRope: RopePosAttention}


# -- the converted Eva ------------------------------------------------------------------------------------------


class _ConvertedModel:
    """What a timm model converted in place shares with :class:`~visionpe.models.vit.VisionPEViT`: its schemes by kind,
    the position context, their parameters out of weight decay and in the stem group (``_stem``: the model's own
    stem parameters, a regex alternative)."""

    pos_schemes: nn.ModuleDict
    _stem: ClassVar[str]

    _schemes = VisionPEViT._schemes
    position_context = VisionPEViT.position_context

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set(super().no_weight_decay()) | schemes_no_weight_decay(self.pos_schemes)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's groups, position parameters with the stem (as the model's own position parameters)."""
        matcher = dict(super().group_matcher(coarse))
        matcher["stem"] = rf"^(?:{self._stem}|pos_schemes(?:\.|$))"
        return matcher


class VisionPEEva(_ConvertedModel, Eva):
    """timm's ``Eva`` whose position encoding is a set of visionpe schemes (``pos_schemes``, names in
    ``pos_embed_names``): what :func:`apply_position_scheme` turns an ``Eva`` into, in place.

    ``_pos_embed`` concatenates the prefix tokens, adds the absolute schemes, applies timm's patch dropout and
    returns the tokens with the :class:`~visionpe.attention.PositionContext` for the grid of the input, which
    timm's ``forward_features`` and ``forward_intermediates`` hand to every block as ``rope``. Everything else is
    timm's. Not built directly: create the ``Eva`` (``timm.create_model``), then call
    :func:`apply_position_scheme`.
    """

    _stem = "cls_token|reg_token|pos_embed|patch_embed|norm_pre"  # with timm's pos_embed

    pos_schemes: nn.ModuleDict
    pos_embed_names: list[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "VisionPEEva is made from an Eva in place: model = timm.create_model(...); "
            "visionpe.integrations.timm.apply_position_scheme(model, pos_embed)"
        )

    # the input checks of a VisionPEViT (type, rank, dtype, channels, size), before timm reads the images
    _input_options = VisionPEViT._input_options
    _input_dtype = VisionPEViT._input_dtype
    _check_input = VisionPEViT._check_input

    def forward_features(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """timm's ``forward_features``, the images ``x`` checked first as a visionpe ViT checks them."""
        self._check_input(x)
        return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, *args: Any, **kwargs: Any):
        """timm's ``forward_intermediates``, ``x`` and ``indices`` checked first."""
        self._check_input(x)
        _feature_indices(indices, len(self.blocks))
        return super().forward_intermediates(x, indices, *args, **kwargs)

    def _pos_embed(self, x: torch.Tensor) -> tuple[torch.Tensor, PositionContext]:
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            grid_size = (H, W)
            x = x.reshape(B, H * W, C)
        else:
            grid_size = tuple(self.patch_embed.grid_size)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)
        for scheme in self._schemes("absolute"):
            x = scheme(x, grid_size, self.num_prefix_tokens)
        x = self.pos_drop(x)
        num_tokens, keep = x.shape[1], None
        if self.patch_drop is not None:
            x, keep = self.patch_drop(x)
        ctx = self.position_context(grid_size, x.device)
        if keep is not None and (ctx.rotary or ctx.bias):
            ctx.keep_tokens(keep, self.num_prefix_tokens, num_tokens)
        return x, ctx

    @torch.jit.ignore
    def set_input_size(self, img_size=None, patch_size=None) -> None:
        """timm's ``set_input_size``; learned tables are resampled, rotary tables follow the grid by design."""
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        for scheme in self.pos_schemes.values():
            scheme.set_grid_size(tuple(self.patch_embed.grid_size))


# -- the converted NaFlexVit ------------------------------------------------------------------------------------


class VisionPENaFlexVit(_ConvertedModel, NaFlexVit):
    """timm's ``NaFlexVit`` whose position encoding is a set of visionpe schemes (``pos_schemes``, names in
    ``pos_embed_names``): what :func:`apply_position_scheme` turns a ``NaFlexVit`` into, in place.

    timm's ``forward`` and ``forward_head`` (pooling over the valid patches) are kept; ``forward_features`` embeds the
    patches with timm's ``embeds`` (its own table removed), then applies the absolute schemes, builds the position
    context and runs the blocks (:class:`~visionpe.attention.PosBlock`) with it. A mixed-resolution batch (timm's
    NaFlex dict, or patches with ``patch_coord`` and ``patch_valid``) is encoded per grid, each image at its own
    (:mod:`visionpe.models.naflex`); a (B, C, H, W) batch as one grid, with timm's patch dropout. Dropout of the
    embeddings (``pos_drop``) runs after the absolute schemes, as in timm. ``forward_intermediates`` is not available
    after the swap (TypeError). Not built directly: create the ``NaFlexVit`` (``timm.create_model("naflexvit_...")``),
    then call :func:`apply_position_scheme`.
    """

    _stem = "embeds"  # with timm's embeds, which held the table

    pos_schemes: nn.ModuleDict
    pos_embed_names: list[str]
    pos_drop: nn.Module

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "VisionPENaFlexVit is made from a NaFlexVit in place: model = timm.create_model('naflexvit_...'); "
            "visionpe.integrations.timm.apply_position_scheme(model, pos_embed)"
        )

    def _check_input(self, x: torch.Tensor) -> None:
        """Images (B, C, H, W) of any size divisible by the patch (any size with ``dynamic_img_pad``), the model's
        dtype outside autocast."""
        embeds = self.embeds
        dtype = embeds.proj.weight.dtype
        _check_images(x, embeds.in_chans, None, tuple(embeds.patch_size), True, embeds.dynamic_img_pad, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor | Mapping[str, Any],
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """timm's ``forward`` (logits of images, or of a mixed-resolution batch pooled over its valid patches), the
        NaFlex batch checked first (:func:`~visionpe.models.naflex.naflex_inputs`: timm would stop at a KeyError or a
        bare AssertionError)."""
        if isinstance(x, Mapping) or patch_coord is not None or patch_valid is not None:
            patches, layout = naflex_inputs(x, patch_coord, patch_valid, attn_mask, unflattened=True)
            features = self.forward_features(patches, layout.patch_coord, layout.patch_valid)
            return self.forward_head(**features)
        return self.forward_head(self.forward_features(x))

    def _forward_embeds(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        raise TypeError(
            "after apply_position_scheme, a NaFlexVit runs its blocks with visionpe's position context: call "
            "forward or forward_features (forward_intermediates is not available on the converted model)"
        )

    def _add_absolute(self, x: torch.Tensor, layout: Any, grid_size: tuple[int, ...] | None, after: int | None):
        """The absolute schemes that run before the blocks (``after`` None) or after block ``after``, per grid for a
        mixed batch (``layout``), else at ``grid_size``."""
        prefix = self.num_prefix_tokens
        for scheme in self._schemes("absolute"):
            if after is None and scheme.insert_after:
                continue
            if after is not None and after not in scheme.insert_after:
                continue
            extra = {} if after is None else {"after_block": after}

            def apply(tokens: torch.Tensor, grid: tuple[int, ...], scheme=scheme, extra=extra) -> torch.Tensor:
                return scheme(tokens, grid, prefix, **extra)

            x = apply(x, grid_size) if layout is None else apply_per_grid(apply, x, layout, prefix)
        return x

    def forward_features(
        self,
        patches: torch.Tensor,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """timm's ``forward_features``: (B, C, H, W) images -> (B, num_prefix_tokens + N, C) tokens; a NaFlex batch
        (``patch_coord`` given) -> ``{"patches": tokens, "patch_valid": patch_valid}``, which ``forward_head`` pools
        over the valid patches."""
        layout, grid_size = None, None
        if patch_coord is not None or patch_valid is not None:
            check_mixed_resolution(SWAP_ENTRY, self.pos_schemes)
            patches, layout = naflex_inputs(patches, patch_coord, patch_valid, attn_mask, unflattened=True)
            _check_dtype(patches, "patches", self.embeds.proj.weight.dtype)
            x, _ = self.embeds(patches, patch_coord=layout.patch_coord, patch_valid=layout.patch_valid)
        else:
            self._check_input(patches)
            x, grid_size = self.embeds(patches)
            grid_size = tuple(int(n) for n in grid_size)
        x = self.pos_drop(self._add_absolute(x, layout, grid_size, None))
        keep, num_tokens = None, x.shape[1]
        if self.training and self.patch_drop is not None:
            if layout is not None:
                raise ValueError(
                    "patch dropout keeps a subset of each grid, which a mixed-resolution batch does not take in "
                    f"training; got patch_drop_rate={self.patch_drop.prob} (call model.eval(), or feed images)"
                )
            x, keep = self.patch_drop(x)
        x = self.norm_pre(x)
        if layout is not None:
            ctx = build_mixed_position_context(self.pos_schemes.values(), self.num_prefix_tokens, layout, x.device)
        else:
            ctx = self.position_context(grid_size, x.device)
            if keep is not None and (ctx.rotary or ctx.bias):
                ctx.keep_tokens(keep, self.num_prefix_tokens, num_tokens)
        checkpointing = self.grad_checkpointing and self.training and not torch.jit.is_scripting()
        for i, blk in enumerate(self.blocks):
            if checkpointing:
                x = checkpoint(blk, x, attn_mask, False, ctx, use_reentrant=False)
            else:
                x = blk(x, attn_mask=attn_mask, pos=ctx)
            x = self._add_absolute(x, layout, grid_size, i)
        x = self.norm(x)
        if layout is not None:
            return {"patches": x, "patch_valid": layout.patch_valid}
        return x


# -- the model's own encoding -----------------------------------------------------------------------------------


@dataclass
class _Translation:
    """One visionpe scheme that reproduces part of the model's own encoding: its options, the values it takes from
    the model (its state-dict names), the coordinate augmentation and the parameters left frozen."""

    options: dict[str, Any]
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    coord_augment: CoordAugment | None = None
    frozen: tuple[str, ...] = ()


def _coord_augment_of(rope: nn.Module) -> CoordAugment | None:
    """timm's training-time shift / jitter / rescale of a rotary module as visionpe's ``dinov3`` augmentation."""
    if not getattr(rope, "aug_active", False):
        return None
    return CoordAugment("dinov3", shift=rope.shift_coords, jitter=rope.jitter_coords, rescale=rope.rescale_coords)


def _require(condition: bool, rope: nn.Module, what: str) -> None:
    if not condition:
        raise ValueError(
            f"the model's {type(rope).__name__} has {what}, which no visionpe scheme reproduces exactly; name the "
            "scheme(s) to use instead (pos_embed=...)"
        )


def _rope_translation(model: Eva) -> tuple[str, _Translation]:
    """(scheme name, translation) of an Eva's rotary module (see the module docstring)."""
    rope, depth, num_heads = model.rope, len(model.blocks), model.blocks[0].attn.num_heads
    mrope_cls = getattr(timm_rope, "RotaryEmbeddingMRope", None)
    if isinstance(rope, timm_rope.RotaryEmbeddingCat):
        grid_type = getattr(rope, "grid_type", "pixel" if rope.in_pixels else "index")  # older timm: in_pixels only
        _require(grid_type == "index", rope, f"grid_type={grid_type!r} (in_pixels=True)")
        _require(rope.grid_indexing in ("ij", "xy"), rope, f"grid_indexing={rope.grid_indexing!r}")
        options = {"base": float(rope.temperature), "axis_order": "yx" if rope.grid_indexing == "ij" else "xy"}
        if rope.grid_offset:  # Perception Encoder: positions i + 1
            options["coord_offset"] = float(rope.grid_offset)
        if rope.ref_feat_shape is not None:  # EVA: i * ref / n, rope_axial's ref_scaled against that grid
            options.update(coord_mode="ref_scaled", grid_size=tuple(int(n) for n in rope.ref_feat_shape))
        return "rope_axial", _Translation(options, coord_augment=_coord_augment_of(rope))
    if isinstance(rope, timm_rope.RotaryEmbeddingMixed):
        _require(rope.grid_indexing in ("ij", "xy"), rope, f"grid_indexing={rope.grid_indexing!r}")
        # timm's component 0 multiplies the grid's first channel: y with "ij", x with "xy"; visionpe's is x
        freqs = rope.freqs.detach()
        freqs = freqs.flip(0) if rope.grid_indexing == "ij" else freqs
        return "rope_mixed", _Translation({"base": float(rope.temperature)}, {"freqs": freqs}, _coord_augment_of(rope))
    if isinstance(rope, timm_rope.RotaryEmbeddingDinoV3):
        _require(rope.grid_offset == 0, rope, f"grid_offset={rope.grid_offset}")
        _require(rope.grid_indexing == "ij", rope, f"grid_indexing={rope.grid_indexing!r} (pairs reading x first)")
        periods = rope.min_period is not None and rope.max_period is not None
        options = {
            "base": None if periods else float(rope.temperature),
            "min_period": rope.min_period if periods else None,
            "max_period": rope.max_period if periods else None,
            "normalize_coords": rope.normalize_coords,
            "shift_coords": rope.shift_coords,
            "jitter_coords": rope.jitter_coords,
            "rescale_coords": rope.rescale_coords,
        }
        return "rope_dinov3", _Translation(options)
    if mrope_cls is not None and isinstance(rope, mrope_cls):
        # channel c turns by inv_freq[c] times y (axis 1), x (axis 2) or the image's temporal position 0 (axis 0)
        inv_freq, axis = rope.inv_freq.detach().float(), rope.axis
        fx, fy = inv_freq * (axis == 2), inv_freq * (axis == 1)
        freqs = torch.stack((fx, fy))[:, None, None].expand(-1, depth, num_heads, -1).clone()
        return "rope_mixed", _Translation({}, {"freqs": freqs}, _coord_augment_of(rope), frozen=("freqs",))
    raise ValueError(
        f"the model's rotary module {type(rope).__name__} has no visionpe translation; name the scheme(s) to use "
        "instead (pos_embed=...)"
    )


def _naflex_translation(model: NaFlexVit, strict: bool = True) -> dict[str, _Translation]:
    """{"learned": translation} of a NaFlexVit's learned table (see the module docstring), {} without a table; a
    table with no exact translation raises ValueError when ``strict``, else gives {} (the schemes are named)."""
    embeds = model.embeds
    if embeds.pos_embed_type == "none":
        return {}
    factorized = embeds.pos_embed_type == "factorized"
    unsupported = {
        "pos_embed_type": (embeds.pos_embed_type, "factorized" if factorized else "learned"),
        "pos_embed_use_grid_sample": (embeds.pos_embed_use_grid_sample, False),
    }
    for option, (value, exact) in unsupported.items():
        if value != exact:
            if not strict:
                return {}
            raise ValueError(
                f"the model's NaFlex position embedding has {option}={value!r}, which no visionpe scheme reproduces "
                f"exactly (only {option}={exact!r} translates); name the scheme(s) to use instead (pos_embed=...)"
            )
    if factorized:  # one table per axis, resampled linearly: NaViT's factorized embedding
        options = {"grid_size": (embeds.pos_embed_y.shape[1], embeds.pos_embed_x.shape[1])}
        options["ar_preserving"] = bool(embeds.pos_embed_ar_preserving)
        weights = {"pos_embed_y": embeds.pos_embed_y, "pos_embed_x": embeds.pos_embed_x}
        return {"learned_factorized": _Translation(options, weights)}
    mode = embeds.pos_embed_interp_mode
    if mode not in ("bicubic", "bilinear", "nearest"):
        if not strict:
            return {}
        raise ValueError(
            f"the model's NaFlex position embedding resamples with pos_embed_interp_mode={mode!r}; visionpe's learned "
            "table takes 'bicubic', 'bilinear' or 'nearest'; name the scheme(s) to use instead (pos_embed=...)"
        )
    table = embeds.pos_embed  # (1, H, W, C)
    height, width = table.shape[1:3]
    options = {
        "grid_size": (int(height), int(width)),
        "no_embed_class": True,
        "interpolation": mode,
        "antialias": bool(embeds.pos_embed_antialias),
        "ar_preserving": bool(embeds.pos_embed_ar_preserving),
        "align_corners": bool(embeds.pos_embed_align_corners),
    }
    return {"learned": _Translation(options, {"pos_embed": table.reshape(1, height * width, -1)})}


def _own_translations(model: nn.Module, strict: bool = True) -> dict[str, _Translation | nn.Module]:
    """{scheme name: translation} of the model's own encoding, or {name: module} for a model already converted.
    ``strict`` False (schemes named by the caller): a NaFlexVit table with no exact translation gives none."""
    if isinstance(model, (VisionPEViT, VisionPEEva, VisionPENaFlexVit)):
        return dict(model.pos_schemes.items())
    if isinstance(model, NaFlexVit):
        return _naflex_translation(model, strict)
    out: dict[str, _Translation | nn.Module] = {}
    if getattr(model, "pos_embed", None) is not None:
        out["learned"] = _Translation({"no_embed_class": bool(model.no_embed_class)}, {"pos_embed": model.pos_embed})
    if isinstance(model, Eva) and model.rope is not None:
        name, translation = _rope_translation(model)
        out[name] = translation
    return out


def own_position_scheme(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The model's own position encoding as visionpe schemes, ``{name: options}`` (``pos_embed`` and
    ``pos_embed_kwargs`` of :func:`apply_position_scheme`), without changing the model.

    Example: EVA-02 gives ``{"learned": {...}, "rope_axial": {"base": 10000.0, "axis_order": "yx", "coord_mode":
    "ref_scaled", "grid_size": (16, 16)}}``. A model converted before gives its schemes with no options (they are
    kept as they are); a model without a position encoding gives ``{}``. TypeError for an unsupported model class,
    ValueError for an encoding with no exact visionpe equivalent (e.g. timm's ``rope_grid_offset`` != 0).
    """
    find_timm_family(model)
    return {
        name: dict(item.options) if isinstance(item, _Translation) else {}
        for name, item in _own_translations(model).items()
    }


# -- the swap ---------------------------------------------------------------------------------------------------


def _build_scheme(name: str, options: dict[str, Any], model: nn.Module, family: TimmFamily) -> nn.Module:
    """One scheme for the model's shape, on its device and floating dtype; ValueError for one it cannot run."""
    scheme = create_model_scheme(model, name, options)
    family.check_scheme(name, scheme)
    dropout = getattr(model.patch_drop, "prob", 0.0) if model.patch_drop is not None else 0.0
    if dropout > 0 and scheme.insert_after:
        raise ValueError(
            f"patch dropout (rate {dropout}) needs every patch on the grid after the embedding, but {name!r} runs "
            f"after blocks {scheme.insert_after}"
        )
    reference = next(iter(model.parameters()))
    scheme.to(device=reference.device)
    if reference.is_floating_point() and reference.dtype != torch.float32:
        scheme.to(dtype=reference.dtype)
    return scheme.train(model.training)


def _scheme_from(
    name: str,
    user_options: dict[str, Any],
    source: _Translation | nn.Module | None,
    model: nn.Module,
    family: TimmFamily,
) -> tuple[nn.Module, list[str]]:
    """The scheme ``name`` for the model, starting from what the model has of it (``source``: its own encoding
    translated, or a visionpe scheme of an earlier swap, kept as it is when no option is given), and the position
    keys that took the model's values."""
    if isinstance(source, nn.Module) and not user_options:
        return source, []
    translated = source.options if isinstance(source, _Translation) else {}
    scheme = _build_scheme(name, {**translated, **user_options}, model, family)
    values = source.state if isinstance(source, _Translation) else source.state_dict() if source else {}
    target = scheme.state_dict()
    matched = {k: v for k, v in values.items() if k in target and target[k].shape == v.shape}
    if matched:
        scheme.load_state_dict(matched, strict=False)
    if isinstance(source, _Translation):
        if source.coord_augment is not None:
            scheme.coord_augment = source.coord_augment
        for pname in source.frozen:
            scheme.get_parameter(pname).requires_grad_(False)
    return scheme, [f"pos_schemes.{name}.{k}" for k in matched]


def _relabel_half_pairs(attn: nn.Module, prefix: str) -> list[str]:
    """Relabel the q and k channels of every head of ``attn`` from the half rotary layout, pairs (c, c + d/2), to
    interleaved pairs (2c, 2c + 1), in place (:func:`half_to_interleaved`); returns the keys changed."""
    head_dim, num_heads = attn.head_dim, attn.num_heads
    order = half_to_interleaved(head_dim)

    def rows(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.unflatten(0, (heads, head_dim))[:, order.to(t.device)].flatten(0, 1)

    changed = []
    with torch.no_grad():
        if attn.qkv is not None:
            qk = 2 * num_heads * head_dim
            for name, t in (("qkv.weight", attn.qkv.weight), ("qkv.bias", attn.qkv.bias)):
                if t is not None:
                    t[:qk] = rows(t[:qk], 2 * num_heads)
                    changed.append(name)
            for name in ("q_bias", "k_bias"):
                t = getattr(attn, name, None)
                if t is not None:
                    t.copy_(rows(t, num_heads))
                    changed.append(name)
        else:
            kv_heads = getattr(attn, "num_kv_heads", num_heads)
            for proj, heads in (("q_proj", num_heads), ("k_proj", kv_heads)):
                for pname, t in getattr(attn, proj).named_parameters():
                    t.copy_(rows(t, heads))
                    changed.append(f"{proj}.{pname}")
        for norm in ("q_norm", "k_norm"):
            for pname, t in getattr(attn, norm).named_parameters():
                if t.shape != (head_dim,):
                    raise ValueError(f"{prefix}{norm}.{pname} has shape {tuple(t.shape)}, expected ({head_dim},)")
                t.copy_(t[order.to(t.device)])
                changed.append(f"{norm}.{pname}")
    persistent = set(attn.state_dict())
    return [f"{prefix}{name}" for name in changed if name in persistent]


def apply_position_scheme(
    model: nn.Module,
    pos_embed: str | Sequence[str] | None = None,
    pos_embed_kwargs: dict[str, Any] | None = None,
) -> SwapReport:
    """Replace the position encoding of a timm ``VisionTransformer`` or ``Eva`` by visionpe schemes, in place.

    Args:
        model: a timm ``VisionTransformer`` (learned table), ``Eva`` (EVA/EVA-02, ``vit_*_rope_*``,
            ``vit_*_dinov3*``, Perception Encoder...; any ``rope_type``) or ``NaFlexVit`` (``naflexvit_*``, standard
            blocks), or a model this function converted before.
        pos_embed: scheme name or list of names, as :class:`~visionpe.models.vit.VisionPEViT`'s
            (``["learned", "rope_axial"]``); None: the model's own encoding translated exactly
            (:func:`own_position_scheme`).
        pos_embed_kwargs: options per scheme (``{"rope_axial": {"base": 100}}``, or flat for one scheme). For a
            scheme of the model's own encoding they update the translated options.

    Returns:
        A :class:`SwapReport`: the position keys added at init, the keys dropped, the keys copied from the model and
        the q/k keys relabelled.

    The model keeps every weight outside its position encoding; its mode (train / eval), device and dtype are kept.
    Schemes the model already has (its own, translated, or those of an earlier swap) start from its values.

    Raises:
        TypeError: ``model`` is of another class or has blocks of another kind (a NaFlexVit with EVA or rotary
            blocks included).
        ValueError: an unknown scheme (the registry's message), a camera or multimodal scheme, a scheme the model
            cannot run (one applied between blocks on an Eva), or ``pos_embed=None`` on a model whose own encoding
            has no exact visionpe equivalent or which has none.

    Example:
        >>> import timm
        >>> model = timm.create_model("vit_small_patch16_rope_224", pretrained=False, depth=1)
        >>> report = apply_position_scheme(model, ["rope_axial", "alibi2d"], {"rope_axial": {"base": 100}})
        >>> sorted(model.pos_schemes)
        ['alibi2d', 'rope_axial']
    """
    family = find_timm_family(model)
    family.check_blocks(model)
    own = _own_translations(model, strict=pos_embed is None)
    if pos_embed is None:
        if not own:
            raise ValueError(
                f"pos_embed=None translates the model's own position encoding, but this {type(model).__name__} has "
                "none; name the scheme(s) to use (pos_embed=...)"
            )
        pos_embed = list(own)
    schemes = normalize_schemes(pos_embed, pos_embed_kwargs, SWAP_ENTRY)
    built = {name: _scheme_from(name, options, own.get(name), model, family) for name, options in schemes.items()}
    # everything is checked and built: change the model
    before = set(model.state_dict())
    permuted = family.install(model)
    model.pos_schemes = nn.ModuleDict({name: scheme for name, (scheme, _) in built.items()})
    model.pos_embed_names = list(built)
    after, copied = set(model.state_dict()), [key for _, keys in built.values() for key in keys]
    return SwapReport(
        added=sorted(after - before - set(copied)),
        dropped=sorted(before - after),
        copied=sorted(copied),
        permuted=permuted,
    )


# -- the supported model families ------------------------------------------------------------------------------


def _install_vit(model: nn.Module) -> list[str]:
    """A VisionTransformer becomes a VisionPEViT: timm's blocks run the schemes, its table is removed."""
    for i, blk in enumerate(model.blocks):
        blk.__class__, blk.attn.__class__ = PosBlock, PosAttention
        blk.attn.layer = i
    model.pos_embed = None
    drop = model.patch_drop
    if isinstance(drop, PatchDropout) and drop.prob > 0:  # the kept indices gather rotations and biases
        model.patch_drop = PatchDropoutWithIndices(drop.prob, drop.num_prefix_tokens, drop.ordered)
    model.__class__ = VisionPEViT
    return []


def _install_eva(model: nn.Module) -> list[str]:
    """An Eva becomes a VisionPEEva: its attention runs the schemes (q/k channels relabelled from the half rotary
    layout), its table and rotary module are removed."""
    permuted = []
    half = model.rope is not None and any(getattr(b.attn, "rotate_half", False) for b in model.blocks)
    for i, blk in enumerate(model.blocks):
        if half:
            permuted += _relabel_half_pairs(blk.attn, f"blocks.{i}.attn.")
        cls = type(blk.attn)
        blk.attn.__class__ = _POS_ATTENTION.get(cls, cls)
        blk.attn.layer, blk.attn.rotate_half = i, False
    model.pos_embed, model.rope, model.rope_mixed = None, None, False
    model.__class__ = VisionPEEva
    return permuted


def _install_naflex(model: nn.Module) -> list[str]:
    """A NaFlexVit becomes a VisionPENaFlexVit: timm's blocks run the schemes, its embeddings' tables are removed."""
    for i, blk in enumerate(model.blocks):
        blk.__class__, blk.attn.__class__ = PosBlock, PosAttention
        blk.attn.layer = i
    embeds = model.embeds
    embeds.pos_embed = embeds.pos_embed_x = embeds.pos_embed_y = None
    embeds.pos_embed_type = "none"
    if not isinstance(model, VisionPENaFlexVit):  # the embeddings' dropout runs after the absolute schemes
        model.pos_drop, embeds.pos_drop = embeds.pos_drop, nn.Identity()
    model.__class__ = VisionPENaFlexVit
    return []


@dataclass(frozen=True)
class TimmFamily:
    """One kind of timm ViT that :func:`apply_position_scheme` converts: one row of :data:`TIMM_FAMILIES`.

    Attributes:
        name: ``"vit"``, ``"eva"`` or ``"naflex"``.
        model: timm's class; ``converted``: the visionpe class it becomes (a converted model is converted again).
        blocks, attentions: the block and attention classes the conversion handles (each block is checked before
            anything changes); ``expected``: how an error names them.
        between_blocks: the converted forward runs schemes applied between blocks and passes extra inputs.
        install: changes a checked model's blocks, own encoding and class; returns the q/k keys it relabelled.
    """

    name: str
    model: type[nn.Module]
    converted: type[nn.Module]
    blocks: tuple[type[nn.Module], ...]
    attentions: tuple[type[nn.Module], ...]
    expected: str
    between_blocks: bool
    install: Callable[[nn.Module], list[str]]

    def check_blocks(self, model: nn.Module) -> None:
        """TypeError naming a block or attention class the conversion does not handle."""
        for i, blk in enumerate(model.blocks):
            if type(blk) not in self.blocks or type(blk.attn) not in self.attentions:
                raise TypeError(
                    f"block {i} is {type(blk).__name__} with {type(blk.attn).__name__}; apply_position_scheme handles "
                    f"{self.expected}"
                )

    def check_scheme(self, name: str, scheme: nn.Module) -> None:
        """ValueError for a scheme the converted forward has no place for."""
        if self.between_blocks:
            return
        if scheme.insert_after:
            raise ValueError(
                f"{name!r} runs after blocks {scheme.insert_after}, between blocks, which timm's "
                f"{self.model.__name__} forward has no place for; use it with a VisionTransformer (VisionPEViT)"
            )
        if scheme.extra_inputs:
            raise ValueError(
                f"{name!r} needs {scheme.extra_inputs} from the model, which timm's {self.model.__name__} forward "
                "does not pass"
            )


_STANDARD = ((Block, PosBlock), (Attention, PosAttention))

#: the timm ViTs :func:`apply_position_scheme` converts, one row a family
TIMM_FAMILIES = (
    TimmFamily("vit", VisionTransformer, VisionPEViT, *_STANDARD, "timm's Block with Attention", True, _install_vit),
    TimmFamily(
        "eva",
        Eva,
        VisionPEEva,
        (EvaBlock, EvaBlockPostNorm),
        (*_POS_ATTENTION, *_POS_ATTENTION.values()),
        "timm's EvaBlock or EvaBlockPostNorm with EvaAttention or AttentionRope",
        False,
        _install_eva,
    ),
    TimmFamily(
        "naflex",
        NaFlexVit,
        VisionPENaFlexVit,
        *_STANDARD,
        "timm's Block with Attention (a NaFlexVit with attn_type='standard' and no rope_type)",
        True,
        _install_naflex,
    ),
)

#: the timm model classes :func:`apply_position_scheme` converts (and the visionpe classes they become)
SUPPORTED_MODELS = tuple(
    f"{cls.__module__}.{cls.__qualname__}"
    for cls in (*(f.model for f in TIMM_FAMILIES), *(f.converted for f in TIMM_FAMILIES))
)


def find_timm_family(model: Any) -> TimmFamily:
    """The row of :data:`TIMM_FAMILIES` of ``model`` (its exact class); TypeError naming the class and the supported
    ones otherwise."""
    for family in TIMM_FAMILIES:
        if type(model) in (family.model, family.converted):
            return family
    raise TypeError(
        f"model must be of a class apply_position_scheme supports ({', '.join(SUPPORTED_MODELS)}), "
        f"got {type(model).__module__}.{type(model).__qualname__}"
    )
