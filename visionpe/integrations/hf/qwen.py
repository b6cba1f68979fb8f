"""Qwen-VL adapter: run a transformers Qwen2-VL, Qwen2.5-VL or Qwen3-VL model with any visionpe multimodal scheme.

``apply_position_scheme(model, "videorope")`` swaps the two halves of the model's M-RoPE (Wang et al.,
"Qwen2-VL", arXiv 2409.12191, 2024) for a visionpe scheme: the position design (the model's
``get_rope_index``, used by ``forward`` and by ``generate``) and the frequency allocation (the language
model's rotary embedding). Decoding with a KV cache keeps working unchanged: transformers advances every
row of the ids by one per new token (``generate``) or adds the stored ``rope_deltas`` to
``cumsum(attention_mask) - 1`` (``forward`` with a cache), and visionpe returns deltas in that convention.
Schemes with fractional positions (V2PE...) return float64 ids and deltas (docs/schemes.md): transformers'
arithmetic on them (integer positions plus the deltas, the text row concatenated in ``generate``, the next ids made
in the ids' dtype) promotes to or keeps float64, nothing on that path casts them down, and the rotary that replaces
the model's takes their angles in fp64 before casting cos and sin to the activations' dtype.

The visual layout comes from ``mm_token_type_ids`` (0 text, 1 image, 2 video), never from the ids or the
embeddings (which cannot tell a visual token from a text one in every case): a patched model raises a ValueError
naming ``mm_token_type_ids`` when visual inputs come without them, in ``forward`` and in ``generate``, where
transformers would fall back to 1-D text positions; with them, an ``inputs_embeds``-only call gets the same
positions as the ``input_ids`` one. Text-only calls need no token types.

Applying another scheme to a patched model replaces the first one (both are built from the model's own rotary
settings), and ``remove_position_scheme(model)`` puts the model's own modules back.

The model classes are imported from transformers by name (``SUPPORTED_MODELS``), so a transformers without one of
them still serves the others. :func:`apply_position_scheme` first checks the installed transformers against the
release the adapter is written for and every method it patches against the signature it expects
(:mod:`visionpe.integrations.hf.compat`): an older interface would bypass the patch or feed it other arguments.
"""

from __future__ import annotations

import importlib
import inspect
import types
from typing import Any

import torch
from torch import nn

from ...multimodal.allocation import ALLOCATIONS
from ...multimodal.ids import get_position_ids
from ...multimodal.ppe_rotary import PPERotary
from ...multimodal.registry import get_multimodal_scheme
from ...multimodal.rotary import MultimodalRotary, apply_multimodal_rotary
from .compat import check_transformers, require_interface
from .layers import LayerPlan, check_attention_implementation
from .layers import install as _install_layer_plan
from .layers import installed_plan as _installed_layer_plan
from .layers import uninstall as _uninstall_layer_plan

__all__ = ["apply_position_scheme", "remove_position_scheme", "SUPPORTED_MODELS"]

# class name of the inner model -> transformers module that defines it
SUPPORTED_MODELS = {
    "Qwen2VLModel": "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "Qwen2_5_VLModel": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "Qwen3VLModel": "transformers.models.qwen3_vl.modeling_qwen3_vl",
}
_ROTARY_OPTIONS = ("mrope_section",)
_PER_BATCH_OPTIONS = ("clusters", "weights")  # PPE's: one batch's tokens, given per call to get_rope_index
_ALLOCATION_DEFAULTS = {"interleaved": (24, 20, 20), "chunked": (16, 24, 24), "lta": (16, 24, 24), "hope": (16, 24, 24)}


def find_model(model: Any, table: dict[str, str]) -> tuple[nn.Module, str] | None:
    """(inner model, its class name) when ``model`` or ``model.model`` is an instance of a class of ``table``
    ({class name: transformers module}; classes missing from the installed transformers are skipped), else None."""
    classes = {}
    for name, module_name in table.items():
        try:
            classes[name] = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    for candidate in (model, getattr(model, "model", None)):
        for name, cls in classes.items():
            if isinstance(candidate, cls):
                return candidate, name
    return None


def _inner_model(model: nn.Module) -> tuple[nn.Module, str]:
    found = find_model(model, SUPPORTED_MODELS)
    if found is None:
        supported = ", ".join(f"{n} (or its ForConditionalGeneration)" for n in SUPPORTED_MODELS)
        raise TypeError(f"apply_position_scheme supports {supported}; got {type(model).__name__}")
    return found


_FEATURE = "visionpe's Qwen-VL adapter"


def _check_interface(model: nn.Module, vl_model: nn.Module) -> None:
    """The installed transformers' release and the methods the adapter replaces, with the arguments it reads.

    ``forward`` reaches the ids through ``compute_3d_position_ids`` and ``generate`` through the outer model's
    ``_prepare_position_ids_for_generation``; both call ``get_rope_index(input_ids, mm_token_type_ids, ...)``.
    """
    check_transformers(_FEATURE)
    layout = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "attention_mask")
    require_interface(_FEATURE, type(vl_model), "get_rope_index", layout)
    require_interface(_FEATURE, type(vl_model), "compute_3d_position_ids", ("input_ids", "inputs_embeds", *layout[1:]))
    if model is not vl_model:
        names = ("inputs_tensor", "model_kwargs")
        require_interface(_FEATURE, type(model), "_prepare_position_ids_for_generation", names)


def _scaled_section(default: tuple[int, int, int], num_pairs: int, interleaved: bool = False) -> tuple[int, int, int]:
    """A (t, h, w) split of ``num_pairs`` in the proportions of ``default``, with h == w where the layout allows it.

    For the interleaved allocation (pair n -> h if n % 3 == 1 and n < 3 s_h, -> w if n % 3 == 2 and n < 3 s_w)
    every section pair must exist, i.e. 3 s_h <= P + 1 and 3 s_w <= P: h and w are each cut to their largest
    value there and t takes the rest (2 pairs -> (1, 1, 0), 5 pairs -> (2, 2, 1)); splits that already fit stay.
    """
    spatial = round(num_pairs * default[1] / sum(default))
    if not interleaved:
        return (num_pairs - 2 * spatial, spatial, spatial)
    s_h, s_w = min(spatial, (num_pairs + 1) // 3), min(spatial, num_pairs // 3)
    return (num_pairs - s_h - s_w, s_h, s_w)


_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
# instance attributes that apply_position_scheme sets: (on the outer model?, name)
_PATCHED_METHODS = (
    (False, "get_rope_index"),
    (False, "compute_3d_position_ids"),
    (True, "_prepare_position_ids_for_generation"),
)


def _require_token_types(scheme: str, inputs: dict[str, Any]) -> None:
    """Raise unless ``inputs`` carry ``mm_token_type_ids`` or no visual input (never an all-text fallback)."""
    visual = [name for name in _VISUAL_INPUTS if inputs.get(name) is not None]
    if visual and inputs.get("mm_token_type_ids") is None:
        raise ValueError(
            f"visionpe scheme {scheme!r} needs mm_token_type_ids (0 text, 1 image, 2 video) to place the visual "
            f"tokens: {', '.join(visual)} came without them. The layout is not read from input_ids or "
            "inputs_embeds, and falling back to all-text positions would be silently wrong; pass the "
            "mm_token_type_ids that the processor returns alongside input_ids."
        )


class _HFRotary(nn.Module):
    """Drop-in for the language model's ``rotary_emb``: ``forward(x, position_ids) -> (cos, sin)`` in x's dtype.

    ``position_ids`` keep their dtype: int64 ids give fp32 angles, float64 ids (fractional schemes) fp64 angles.

    It keeps what it replaced: the model's own rotary module (a submodule, so that ``.to()`` moves it along; its
    buffers are non-persistent and stay out of the state dict) and, in ``originals``, any instance attribute that
    the patched methods of ``_PATCHED_METHODS`` shadow (``None`` where there was none, the usual case).
    """

    def __init__(self, rotary: MultimodalRotary, original: nn.Module, originals: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.rotary = rotary
        self.original = original
        self.originals = dict(originals or {})

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rotary.mix.shape[1]  # 3, or 3K for PPE's K positions per token
        if rows != 3 and position_ids.ndim == 3 and position_ids.shape[0] == rows + 1:
            # generate puts a text row in front of the scheme's ids; transformers drops it only from 4 rows
            position_ids = position_ids[1:]
        return self.rotary(position_ids.to(x.device), dtype=x.dtype)


def _own_method(obj: Any, name: str) -> Any:
    """``obj``'s method ``name`` as it was before patching: a shadowed instance attribute, else the class's."""
    wrapper = _wrapper_of(obj.model if name == "_prepare_position_ids_for_generation" else obj)
    previous = wrapper.originals.get(name) if wrapper is not None else None
    return previous if previous is not None else getattr(type(obj), name).__get__(obj)


def _wrapper_of(vl_model: nn.Module) -> _HFRotary | None:
    rotary = getattr(getattr(vl_model, "language_model", None), "rotary_emb", None)
    return rotary if isinstance(rotary, _HFRotary) else None


def _compute_3d_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Per-instance ``compute_3d_position_ids`` of a patched model (``forward`` calls it when no position_ids come).

    transformers returns ``None`` (1-D text positions) where it cannot use ``get_rope_index``: without
    ``mm_token_type_ids`` (Qwen2.5-VL does not check) or without ``input_ids``. Here visual inputs without token
    types are an error, and with token types an ``inputs_embeds``-only call gets the scheme's ids from them.
    """
    own = _own_method(self, "compute_3d_position_ids")
    if _wrapper_of(self) is None:  # the scheme was removed through a path that left this attribute
        return own(*args, **kwargs)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [n for n, p in inspect.signature(own).parameters.items() if p.kind in positional]
    given = {**dict(zip(names, args, strict=False)), **kwargs}  # transformers passes keywords; args are fewer
    _require_token_types(self.visionpe_scheme, given)
    types_ = given.get("mm_token_type_ids")
    has_grid = given.get("image_grid_thw") is not None or given.get("video_grid_thw") is not None
    cache = given.get("cache", given.get("past_key_values"))
    cache_length = 0 if cache is None else cache.get_seq_length()
    if (
        given.get("input_ids") is None
        and types_ is not None
        and has_grid
        and (self.rope_deltas is None or cache_length == 0)
    ):
        # the same branch transformers takes with input_ids: the scheme's ids need only the token types
        position_ids, self.rope_deltas = self.get_rope_index(
            None,
            mm_token_type_ids=types_,
            image_grid_thw=given.get("image_grid_thw"),
            video_grid_thw=given.get("video_grid_thw"),
            attention_mask=given.get("attention_mask"),
            second_per_grid_ts=given.get("second_per_grid_ts"),
        )
        embeds = given.get("inputs_embeds")
        return position_ids if embeds is None else position_ids.to(embeds.device)
    return own(*args, **kwargs)


def _prepare_position_ids_for_generation(self, inputs_tensor: torch.Tensor, model_kwargs: dict[str, Any]):
    """Per-instance ``_prepare_position_ids_for_generation`` of a patched ``*ForConditionalGeneration``.

    ``generate`` builds the positions here, once, and passes them to every ``forward``; transformers falls back to
    text positions without ``mm_token_type_ids`` or when the prompt is ``inputs_embeds``. Visual inputs without
    token types are an error; with them, an ``inputs_embeds`` prompt gets its ids from the types.
    """
    own = _own_method(self, "_prepare_position_ids_for_generation")
    if _wrapper_of(self.model) is None:  # patched through the outer model, removed through the inner one
        return own(inputs_tensor, model_kwargs)
    _require_token_types(self.model.visionpe_scheme, model_kwargs)
    plan = _installed_layer_plan(self.model)
    if plan is not None:  # generate drops the grids before the prefill: a mask or per-layer ids need them there
        plan.remember_generation(model_kwargs)
    types_ = model_kwargs.get("mm_token_type_ids")
    has_grid = model_kwargs.get("image_grid_thw") is not None or model_kwargs.get("video_grid_thw") is not None
    ids = model_kwargs.get("input_ids")
    if ids is not None and ids.shape[1] > 0:
        inputs_tensor = ids
    is_ids = inputs_tensor.ndim == 2 and inputs_tensor.dtype in (torch.int, torch.long)
    if types_ is not None and has_grid and not is_ids:
        # An inputs_embeds prompt: the adapter's get_rope_index reads only the token types, so they stand in for the
        # input_ids that transformers looks for (same shape: one per prompt token).
        inputs_tensor = types_.long()
    return own(inputs_tensor, model_kwargs)


_compute_3d_position_ids.visionpe_patch = True
_prepare_position_ids_for_generation.visionpe_patch = True


def _dispatching_apply(original):
    """The modeling module's ``apply_rotary_pos_emb`` extended to per-head (B, H_kv, L, D) tables (MHRoPE)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if cos.ndim == 4:
            return apply_multimodal_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.visionpe_original = original
    return apply_rotary_pos_emb


def apply_position_scheme(model: nn.Module, scheme: str, **kwargs: Any) -> nn.Module:
    """Make a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model use the visionpe scheme ``scheme``, in place.

    Args:
        model: a ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration`` or
            ``Qwen3VLForConditionalGeneration`` (or their inner ``*Model``).
        scheme: a name from :func:`visionpe.multimodal.list_multimodal_schemes`.
        **kwargs: the scheme's design options (``continuation=``, ``delta=``, ``spatial_reset=``...) and
            ``mrope_section=`` for the allocation. Defaults come from the model: rope_theta, its
            mrope_section where the allocation can use it, ``vision_config.tokens_per_second`` and
            ``spatial_merge_size``. ``second_per_grid_ts`` is a per-call input of Qwen2.5-VL's ``forward`` and
            ``generate``. ``ppe`` with ``num_representatives=K`` > 1 installs
            :class:`~visionpe.multimodal.PPERotary` (ids of 3K rows); its per-batch ``clusters`` and ``weights``
            go to the patched ``model.get_rope_index(..., clusters=...)``, whose ids ``forward`` then takes as
            ``position_ids``.

    Returns:
        The same model; ``model.visionpe_scheme`` records the scheme.

    Raises:
        TypeError, ValueError: for an unsupported model, an unknown scheme or option, or an option value the
            scheme does not accept (the message names the argument, what it takes and what it got). Every
            option is checked before anything is patched: after an error the model is as it was.
        ImportError: (:class:`~visionpe.integrations.hf.compat.UnsupportedTransformersError`) for a transformers
            older than the adapter supports or without a method it patches; the message names the installed
            version, the supported range and the install command.

    With ``scheme="mrope"`` on Qwen2-VL the logits equal the unpatched model's on image inputs (both
    continuation rules agree there); on videos visionpe defaults to the original Qwen2-VL rule
    (``continuation="max_plus_one"``), pass ``continuation="spatial_extent"`` for transformers 5.x's.
    Head-wise allocations (``mhrope``) produce per-head tables (B, H_kv, L, D); for them the model family's
    ``apply_rotary_pos_emb`` is replaced, once per process, by a version that routes 4-D tables to
    :func:`~visionpe.multimodal.apply_multimodal_rotary` and everything else to the original.

    Schemes with per-layer ids (``pype``, which needs ``interval=``; ``circle_rope`` with ``age=True``) and schemes
    that change the attention mask inside each visual block (``cca``, ``pype``) get the model's ``forward``, its
    language model's rotary and each decoder layer's ``forward`` replaced per instance
    (:mod:`visionpe.integrations.hf.layers`): when the prompt is encoded the model builds every layer's ids and an
    additive (B, 1, L, L) mask from the 2-D attention mask, the token types and the grids; decoding steps with a cache
    shift each layer's text positions by that layer's decoding delta and keep the plain causal mask. The masks need
    eager or SDPA attention: ``flash_attention_2`` (which would drop them silently) or any other implementation is a
    ValueError when the scheme is applied and when the model is called. Visual tokens must all be in the first
    (uncached) call.

    The visual layout comes from ``mm_token_type_ids`` only: the patched ``forward`` and
    ``generate`` raise a ValueError naming it when visual inputs (``pixel_values``, ``pixel_values_videos``,
    ``image_grid_thw``, ``video_grid_thw``) come without it, where transformers would use 1-D text positions, and
    with it an ``inputs_embeds`` prompt gets the same positions as its ``input_ids``. Text-only calls need no token
    types. ``generate`` is covered when the ``*ForConditionalGeneration`` itself is patched (patching its inner
    ``*Model`` covers ``forward``).

    On a model patched before, the new scheme replaces the old one and is built from the model's own rotary
    settings, as on a fresh model: ``apply_position_scheme(apply_position_scheme(m, "mrope"), "videorope")``
    behaves as ``apply_position_scheme(m, "videorope")``. :func:`remove_position_scheme` undoes the patch.
    """
    vl_model, class_name = _inner_model(model)
    _check_interface(model, vl_model)
    entry = get_multimodal_scheme(scheme)
    design_kwargs = {k: v for k, v in kwargs.items() if k not in _ROTARY_OPTIONS}
    unknown = [k for k in design_kwargs if k not in entry.design_options()]
    if unknown:
        raise ValueError(
            f"{scheme} got unknown option(s) {unknown}; valid options: {entry.design_options() + list(_ROTARY_OPTIONS)}"
        )
    if "second_per_grid_ts" in design_kwargs:
        raise ValueError("second_per_grid_ts is a per-call input: pass it to forward() / generate(), not here")
    per_batch = [name for name in _PER_BATCH_OPTIONS if name in design_kwargs]
    if per_batch:
        raise ValueError(
            f"{', '.join(per_batch)} describe one batch's tokens: pass them to the patched model's "
            "model.get_rope_index(...) (then position_ids= to forward), not to apply_position_scheme"
        )
    if entry.layer_of is not None and "layer" in design_kwargs:
        raise ValueError(
            f"{scheme}: layer is set per decoder layer by the adapter, got layer={design_kwargs['layer']!r}"
        )
    missing = [name for name in entry.required_options if design_kwargs.get(name) is None]
    if missing:
        raise ValueError(f"apply_position_scheme({scheme!r}) needs {', '.join(missing)}=: it has no default")
    if entry.block_mask:
        check_attention_implementation(vl_model.language_model.config, scheme)
    current_rotary = vl_model.language_model.rotary_emb
    patched_before = isinstance(current_rotary, _HFRotary)
    # the model's own rotary module, also when a scheme was applied before (its settings are the defaults)
    original_rotary = current_rotary.original if patched_before else current_rotary
    text_config = vl_model.config.text_config
    vision_config = vl_model.config.vision_config
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    from ...multimodal.rotary import RopeScaling  # the model's RoPE scaling, applied to the scheme's frequencies

    try:
        rope_scaling = RopeScaling.from_rope_parameters(rope, getattr(text_config, "max_position_embeddings", None))
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"apply_position_scheme: the model's text_config.rope_parameters are not supported: {err}") from err
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    num_pairs = head_dim // 2

    rotary_kwargs: dict[str, Any] = {}
    if "mrope_section" in kwargs:
        rotary_kwargs["mrope_section"] = _checked_section(kwargs["mrope_section"], scheme, entry.allocation)
    elif entry.allocation in _ALLOCATION_DEFAULTS:
        own = tuple(rope.get("mrope_section") or ())
        fits = len(own) == 3 and sum(own) == num_pairs
        if entry.allocation == "lta" or entry.allocation == "hope":
            fits = fits and own[1] == own[2]
        if entry.allocation == "interleaved":
            fits = fits and class_name == "Qwen3VLModel"
        if entry.allocation == "chunked":
            fits = fits and class_name != "Qwen3VLModel"
        rotary_kwargs["mrope_section"] = (
            own
            if fits
            else _scaled_section(
                _ALLOCATION_DEFAULTS[entry.allocation], num_pairs, interleaved=entry.allocation == "interleaved"
            )
        )
    if entry.allocation == "head":
        rotary_kwargs["num_kv_heads"] = text_config.num_key_value_heads
    # PPE with K > 1 representatives: ids (3K, B, L), each M-RoPE section cut into K sub-bands
    representatives = design_kwargs.get("num_representatives", 1) if scheme == "ppe" else 1
    rotary_class = PPERotary if isinstance(representatives, int) and representatives > 1 else MultimodalRotary
    if rotary_class is PPERotary:
        rotary_kwargs["num_representatives"] = representatives
    rotary = rotary_class.from_scheme(
        scheme,
        head_dim,
        base=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,  # its attention scaling (YaRN's) included
        **rotary_kwargs,
    )
    spatial_merge_size = int(vision_config.spatial_merge_size)
    if scheme == "mrope_abs_time" and "tokens_per_second" not in design_kwargs:
        design_kwargs["tokens_per_second"] = float(getattr(vision_config, "tokens_per_second", 2))
    _check_design_options(scheme, design_kwargs, spatial_merge_size)
    takes_time = "second_per_grid_ts" in entry.design_options()
    splits_videos = class_name == "Qwen3VLModel"
    try:  # per-layer ids (PyPE, AGE) and intra-block masks (CCA, PyPE): checked here, installed after patching
        layer_plan = LayerPlan(
            entry,
            design_kwargs,
            int(text_config.num_hidden_layers),
            spatial_merge_size=spatial_merge_size,
            split_videos=splits_videos,
            takes_time=takes_time,
        )
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"apply_position_scheme({scheme!r}): {err}") from err

    def get_rope_index(
        self,
        input_ids: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        clusters: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if mm_token_type_ids is None:
            raise ValueError(f"visionpe scheme {scheme!r} needs mm_token_type_ids (0 text, 1 image, 2 video)")
        given = {name: value for name, value in (("clusters", clusters), ("weights", weights)) if value is not None}
        if given and scheme != "ppe":
            raise ValueError(f"{', '.join(given)} are PPE's per-batch inputs; the model runs {scheme!r}")
        if splits_videos and video_grid_thw is not None:
            # Qwen3-VL frames are separate T = 1 blocks with timestamp text between them.
            video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
            video_grid_thw[:, 0] = 1
        options = dict(design_kwargs) | given
        if takes_time and second_per_grid_ts is not None:
            options["second_per_grid_ts"] = second_per_grid_ts
        return get_position_ids(
            scheme,
            mm_token_type_ids,
            image_grid_thw,
            video_grid_thw,
            attention_mask,
            spatial_merge_size=spatial_merge_size,
            pad_value=0,
            delta_convention="valid",
            **options,
        )

    get_rope_index.visionpe_patch = True  # marks the adapter's methods, see remove_position_scheme

    # Everything above only reads the model; from here on it is patched.
    outer = model if model is not vl_model else None
    targets = {name: outer if on_outer else vl_model for on_outer, name in _PATCHED_METHODS}
    originals = {}
    for name, obj in targets.items():
        if obj is None:
            continue
        current = obj.__dict__.get(name)
        if getattr(current, "visionpe_patch", False):  # ours, from an earlier apply: keep what that one replaced
            current = current_rotary.originals.get(name) if patched_before else None
        originals[name] = current
    vl_model.get_rope_index = types.MethodType(get_rope_index, vl_model)
    vl_model.compute_3d_position_ids = types.MethodType(_compute_3d_position_ids, vl_model)
    if outer is not None:
        outer._prepare_position_ids_for_generation = types.MethodType(_prepare_position_ids_for_generation, outer)
    wrapper = _HFRotary(rotary, original_rotary, originals)
    _uninstall_layer_plan(vl_model)  # an earlier scheme's, before its rotary is replaced
    vl_model.language_model.rotary_emb = wrapper.to(original_rotary.inv_freq.device)
    vl_model.rope_deltas = None
    _install_layer_plan(vl_model, layer_plan)
    if rotary.per_head:
        modeling = importlib.import_module(SUPPORTED_MODELS[class_name])
        if not hasattr(modeling.apply_rotary_pos_emb, "visionpe_original"):
            modeling.apply_rotary_pos_emb = _dispatching_apply(modeling.apply_rotary_pos_emb)
    model.visionpe_scheme = scheme
    vl_model.visionpe_scheme = scheme
    return model


def _restore_methods(
    model: nn.Module, vl_model: nn.Module, patched: tuple[tuple[bool, str], ...], originals: dict[str, Any]
) -> None:
    """Remove the methods visionpe patched onto the outer model (``on_outer``) or the inner one, and put back an
    instance attribute of the same name that a patch shadowed (``originals``)."""
    outer = model if model is not vl_model else None
    for on_outer, name in patched:
        obj = outer if on_outer else vl_model
        if obj is None or not getattr(obj.__dict__.get(name), "visionpe_patch", False):
            continue
        del obj.__dict__[name]
        if originals.get(name) is not None:
            setattr(obj, name, originals[name])


def remove_position_scheme(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_position_scheme`, in place: the model runs with its own position scheme again.

    The language model's own rotary module and the class's ``get_rope_index``, ``compute_3d_position_ids`` and
    ``_prepare_position_ids_for_generation`` (of a ``*ForConditionalGeneration``) are put back (and the forwards
    replaced for per-layer ids or masks, see :func:`apply_position_scheme`), the cached
    ``rope_deltas`` are cleared and ``visionpe_scheme`` is deleted, so the logits equal the unpatched model's
    exactly. (Patched through the ``*ForConditionalGeneration`` and removed through its inner ``*Model``, the outer
    model keeps an inert ``_prepare_position_ids_for_generation`` that defers to the class's: remove through the
    model that was patched.) A model that is not patched is returned unchanged. The process-wide
    ``apply_rotary_pos_emb`` dispatcher installed for head-wise schemes stays: it passes the model's own (B, L, D)
    tables to the original.

    Args:
        model: a model (or inner ``*Model``) accepted by :func:`apply_position_scheme`.

    Returns:
        The same model.

    Example:
        >>> apply_position_scheme(model, "videorope")  # doctest: +SKIP
        >>> remove_position_scheme(model)  # doctest: +SKIP
    """
    vl_model, _ = _inner_model(model)
    current = vl_model.language_model.rotary_emb
    _restore_methods(model, vl_model, _PATCHED_METHODS, current.originals if isinstance(current, _HFRotary) else {})
    _uninstall_layer_plan(vl_model)
    if isinstance(current, _HFRotary):
        vl_model.language_model.rotary_emb = current.original
        vl_model.rope_deltas = None
    for obj in (model, vl_model):
        obj.__dict__.pop("visionpe_scheme", None)
    return model


def _checked_section(section: Any, scheme: str, allocation: str) -> tuple[int, ...]:
    """``mrope_section`` as a tuple, if the scheme's allocation takes one; its values are checked by the allocation."""
    if "mrope_section" not in inspect.signature(ALLOCATIONS[allocation]).parameters:
        raise ValueError(f"{scheme} uses the {allocation!r} allocation, which takes no mrope_section; got {section!r}")
    if not isinstance(section, (list, tuple)):
        raise TypeError(
            f"mrope_section must be a list or tuple of three non-negative ints (t, h, w), "
            f"got {type(section).__name__} ({section!r})"
        )
    return tuple(section)


def _check_design_options(scheme: str, options: dict[str, Any], spatial_merge_size: int) -> None:
    """Run the scheme's position design once on a one-image batch, so that bad option values fail here.

    A (B,) tensor option (per-sample values) sets the batch size of the trial run.
    """
    batch_size = 1
    for value in options.values():
        if isinstance(value, torch.Tensor) and value.ndim == 1 and value.numel():
            batch_size = value.numel()
    types_ = torch.tensor([[0, 1, 0]]).expand(batch_size, -1)
    image_grid = torch.tensor([[1, spatial_merge_size, spatial_merge_size]]).repeat(batch_size, 1)
    try:
        get_position_ids(scheme, types_, image_grid, spatial_merge_size=spatial_merge_size, pad_value=0, **options)
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"apply_position_scheme({scheme!r}): {err}") from err
