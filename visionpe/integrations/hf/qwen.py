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

Where each model keeps its ids, rotary and attention, and which of its methods the adapter replaces, is the model's
row of :data:`~visionpe.integrations.hf.families.FAMILIES`; the steps shared with the 1-D RoPE adapter are in
:mod:`~visionpe.integrations.hf.adapter`. Everything is patched on the model instance: another model of the same
class in the process keeps transformers' own behaviour. The model classes are imported from transformers by name
(``SUPPORTED_MODELS``), so a transformers without one of them still serves the others. :func:`apply_position_scheme`
first checks the installed transformers against the release the adapter is written for and every method it patches
against the signature it expects (:mod:`visionpe.integrations.hf.compat`): an older interface would bypass the patch
or feed it other arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...checks import check_instance, check_tensor
from ...multimodal.cca import visual_block_mask
from ...multimodal.design import assemble_positions, parse_layout
from ...multimodal.ids import get_position_ids
from ...multimodal.ppe_rotary import PPERotary
from ...multimodal.registry import MultimodalScheme
from ...multimodal.rotary import MultimodalRotary, RopeScaling
from .adapter import (
    COLLATED_INPUTS,
    LAYER_INPUTS,
    Adapter,
    PatchState,
    Prepared,
    apply_scheme,
    bind_arguments,
    check_design_options,
    own_method,
    remove_scheme,
    rotary_options,
    state_of,
)
from .families import VLMFamily, find_model, models_of
from .layers import LayerPlan, _Call, check_attention_implementation, split_video_frames
from .layers import installed_plan as _installed_layer_plan

__all__ = [
    "apply_position_scheme",
    "remove_position_scheme",
    "SUPPORTED_MODELS",
    "find_model",
    "check_scheme_options",
    "scheme_position_ids",
    "layer_position_tensors",
]

ADAPTER = "qwen"
# class name of the inner model -> transformers module that defines it (the families this adapter runs)
SUPPORTED_MODELS = models_of(ADAPTER)
_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
_TIME = "second_per_grid_ts"  # the video timing that Qwen2.5-VL's forward and generate take per call
_BATCH_INPUTS = ("clusters", "weights")  # per-batch design inputs that the patched get_rope_index takes


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


class _QwenState(PatchState):
    """A patched Qwen-VL model's scheme, with the vision config's merge size and whether the design takes timing."""

    def __init__(
        self, entry: MultimodalScheme, options: dict[str, Any], family: VLMFamily, spatial_merge_size: int
    ) -> None:
        super().__init__(entry, options, family)
        self.spatial_merge_size = spatial_merge_size
        self.takes_time = _TIME in entry.design_options()


def _get_rope_index(
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
    """Per-instance ``get_rope_index`` of a patched model: the scheme's ids and decoding deltas from the token types
    and the grids (``input_ids`` are not read); ``clusters`` and ``weights`` for designs that take them (PPE)."""
    state = state_of(self)
    given = {"clusters": clusters, "weights": weights, _TIME: second_per_grid_ts}
    return scheme_position_ids(state, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, given)


def _call_options(state: _QwenState, inputs: dict[str, Any]) -> dict[str, Any]:
    """The design options of one call: the model's, PPE's per-batch ``clusters`` / ``weights`` and the video timing."""
    given = {name: inputs.get(name) for name in _BATCH_INPUTS if inputs.get(name) is not None}
    if not set(given) <= set(state.entry.call_inputs):
        raise ValueError(f"{', '.join(given)} are PPE's per-batch inputs; the model runs {state.scheme!r}")
    options = dict(state.options) | given
    if state.takes_time and inputs.get(_TIME) is not None:
        options[_TIME] = inputs[_TIME]
    return options


def scheme_position_ids(
    state: _QwenState,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    inputs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and decoding deltas that the patched ``get_rope_index`` gives for one batch (the collator's too).

    Args:
        state: the patched model's state (or a collator's, built alike).
        mm_token_type_ids: (B, L) 0 text, 1 image, 2 video.
        image_grid_thw, video_grid_thw: the processor's grids (videos unsplit: Qwen3-VL's frames are split here).
        attention_mask: (B, L) or None.
        inputs: the call's other inputs, of which PPE's ``clusters`` / ``weights`` and ``second_per_grid_ts`` are
            read.

    Returns:
        (R, B, L) ids and (B, 1) deltas, transformers 5.x conventions (pads 0, deltas against the valid length).
    """
    if mm_token_type_ids is None:
        raise ValueError(f"visionpe scheme {state.scheme!r} needs mm_token_type_ids (0 text, 1 image, 2 video)")
    options = _call_options(state, inputs or {})
    if state.family.split_videos and video_grid_thw is not None:
        # Qwen3-VL frames are separate T = 1 blocks with timestamp text between them.
        video_grid_thw = split_video_frames(video_grid_thw)
    return get_position_ids(
        state.scheme,
        mm_token_type_ids,
        image_grid_thw,
        video_grid_thw,
        attention_mask,
        spatial_merge_size=state.spatial_merge_size,
        pad_value=0,
        delta_convention="valid",
        **options,
    )


def layer_position_tensors(
    state: _QwenState,
    plan: LayerPlan,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    inputs: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Everything a patched model with a per-layer plan (PyPE, Circle-RoPE's AGE, CCA) takes for one padded batch.

    One design run per distinct layer variant (``plan.variants``, in that order; V of them):
    ``position_ids`` (R, B, L) and ``rope_deltas`` (B, 1) of layer 0's variant, what ``get_rope_index`` gives;
    with several variants ``layer_position_ids`` (V, R, B, L) and ``layer_rope_deltas`` (V, B, 1); for a block-mask
    design ``layer_attention_mask`` (V, B, L, L), True where key k is visible to query q (causal, and inside each
    visual block by level).
    """
    if mm_token_type_ids is None:
        raise ValueError(f"visionpe scheme {state.scheme!r} needs mm_token_type_ids (0 text, 1 image, 2 video)")
    options = _call_options(state, inputs or {})
    if state.family.split_videos and video_grid_thw is not None:
        video_grid_thw = split_video_frames(video_grid_thw)
    layout = parse_layout(mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, state.spatial_merge_size)
    ids, deltas, allowed = [], [], []
    for variant in plan.variants:
        design = state.entry.run_design(layout, {**options, "layer": variant} if state.entry.layer_of else options)
        pos, delta = assemble_positions(layout, design, pad_value=0, delta_convention="valid")
        ids.append(pos)
        deltas.append(delta)
        if plan.block_mask:
            allowed.append(visual_block_mask(layout, design.local[0]))
    base = plan.variants.index(plan.base)
    out = {"position_ids": ids[base], "rope_deltas": deltas[base]}
    if len(plan.variants) > 1:
        out["layer_position_ids"] = torch.stack(ids)
        out["layer_rope_deltas"] = torch.stack(deltas)
    if plan.block_mask:
        out["layer_attention_mask"] = torch.stack(allowed)
    return out


def _compute_3d_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Per-instance ``compute_3d_position_ids`` of a patched model (``forward`` calls it when no position_ids come).

    transformers returns ``None`` (1-D text positions) where it cannot use ``get_rope_index``: without
    ``mm_token_type_ids`` (Qwen2.5-VL does not check) or without ``input_ids``. Here visual inputs without token
    types are an error, and with token types an ``inputs_embeds``-only call gets the scheme's ids from them.
    """
    state = state_of(self)
    own = own_method(self, "compute_3d_position_ids", state)
    if state is None:  # the scheme was removed through a path that left this attribute
        return own(*args, **kwargs)
    given = bind_arguments(own, args, kwargs)  # transformers passes keywords; args are fewer
    _require_token_types(state.scheme, given)
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
            second_per_grid_ts=given.get(_TIME),
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
    state = state_of(self.model)
    own = own_method(self, "_prepare_position_ids_for_generation", state)
    if state is None:  # patched through the outer model, removed through the inner one
        return own(inputs_tensor, model_kwargs)
    _require_token_types(state.scheme, model_kwargs)
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


class _CollatedLayerPlan(LayerPlan):
    """The per-layer plan of a patched Qwen-VL model, which takes a collator's per-layer tensors as given.

    With ``layer_position_ids`` / ``layer_attention_mask`` in the call (:func:`layer_position_tensors`, built in the
    data loader) no design runs in the forward: the offsets of each variant are read from the stacked ids, the masks
    are the given ones, and the decoding deltas of each variant come from ``layer_rope_deltas``. Without them the
    plan builds everything itself (:meth:`LayerPlan.prepare`).
    """

    def prepare(self, model: nn.Module, given: dict[str, Any]) -> _Call | None:
        layer_ids, layer_deltas = given.get("layer_position_ids"), given.get("layer_rope_deltas")
        allowed = given.get("layer_attention_mask")
        if layer_ids is None and layer_deltas is None and allowed is None:
            return super().prepare(model, given)
        if self.block_mask:
            check_attention_implementation(model.language_model.config, self.scheme)
        cache = given.get("cache", given.get("past_key_values"))
        if cache is not None and cache.get_seq_length():
            raise ValueError(
                f"layer_position_ids, layer_rope_deltas and layer_attention_mask describe a whole prompt; the call "
                f"has {cache.get_seq_length()} cached tokens (decoding steps take neither: the model continues the "
                "ids from the prompt's layer_rope_deltas)"
            )
        position_ids = given.get("position_ids")
        if position_ids is None:
            raise ValueError(
                f"visionpe scheme {self.scheme!r} got per-layer inputs without position_ids: pass the collator's "
                "position_ids (layer 0's ids) with them"
            )
        batch, length = position_ids.shape[-2:]
        count = len(self.variants)
        several = count > 1
        if several != (layer_ids is not None) or several != (layer_deltas is not None):
            raise ValueError(
                f"visionpe scheme {self.scheme!r} with these options gives the decoder layers {count} sets of ids: "
                f"it takes layer_position_ids and layer_rope_deltas {'with' if several else 'without'} them, got "
                f"layer_position_ids {_shape(layer_ids)} and layer_rope_deltas {_shape(layer_deltas)}"
            )
        if self.block_mask != (allowed is not None):
            raise ValueError(
                f"visionpe scheme {self.scheme!r} {'needs' if self.block_mask else 'takes no'} layer_attention_mask "
                f"(its mask inside visual blocks), got {_shape(allowed)}"
            )
        offsets, masks = {}, {}
        if several:
            expected = (count, *position_ids.shape)
            check_tensor(layer_ids, "layer_position_ids", dtype="real", expected=f"a {expected} tensor")
            check_tensor(layer_deltas, "layer_rope_deltas", dtype="real", expected=f"a ({count}, {batch}, 1) tensor")
            if tuple(layer_ids.shape) != expected or tuple(layer_deltas.shape) != (count, batch, 1):
                raise ValueError(
                    f"layer_position_ids must be {expected} (one set of ids per layer variant {self.variants}) and "
                    f"layer_rope_deltas ({count}, {batch}, 1), got {tuple(layer_ids.shape)} and "
                    f"{tuple(layer_deltas.shape)}"
                )
            base = self.variants.index(self.base)
            offsets = {v: layer_ids[i] - layer_ids[base] for i, v in enumerate(self.variants) if v != self.base}
            self.deltas = {v: layer_deltas[i] - layer_deltas[base] for i, v in enumerate(self.variants) if i != base}
        else:
            self.deltas = None
        if allowed is not None:
            expected = (count, batch, length, length)
            if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
                raise TypeError(
                    f"layer_attention_mask must be a {expected} bool tensor (True: visible), got "
                    f"{getattr(allowed, 'dtype', type(allowed).__name__)}"
                )
            if tuple(allowed.shape) != expected:
                raise ValueError(f"layer_attention_mask must be {expected} (V, B, L, L), got {tuple(allowed.shape)}")
            masks = {v: allowed[i] for i, v in enumerate(self.variants)}
        self.alias = {}
        return _Call(offsets, masks, {})


def _shape(value: Any) -> str:
    return "None" if value is None else str(tuple(value.shape)) if isinstance(value, torch.Tensor) else repr(value)


def _forward(self, *args: Any, **kwargs: Any) -> Any:
    """Per-instance ``forward`` of a patched inner model: takes what a collator adds beside ``position_ids``.

    ``rope_deltas`` (B, 1) become the model's decoding deltas (a later cached forward continues from this batch's,
    never an earlier batch's); the per-layer inputs were read by the layer plan (:class:`_CollatedLayerPlan`), which
    runs before this forward; ``cu_seqlens`` / ``max_seqlen`` of a packed row are dropped, since transformers finds
    the samples from ``position_ids[0]``. All are popped: transformers would pass unknown keywords on to the vision
    tower (which reads a ``cu_seqlens`` of its own) and the attention.
    """
    state = state_of(self)
    own = own_method(self, "forward", state)
    collated = {name: kwargs.pop(name) for name in COLLATED_INPUTS if name in kwargs}
    if state is None:  # removed through a path that left this attribute
        return own(*args, **kwargs)
    layer_inputs = [name for name in LAYER_INPUTS if collated.get(name) is not None]
    if layer_inputs and _installed_layer_plan(self) is None:
        raise ValueError(
            f"{', '.join(layer_inputs)} are for schemes with per-layer ids or a mask inside visual blocks; the model "
            f"runs {state.scheme!r}, which has neither: build the batch with a collator of this model"
        )
    given = bind_arguments(own, args, kwargs)
    packed = [name for name in ("cu_seqlens", "max_seqlen") if collated.get(name) is not None]
    if packed and given.get("position_ids") is None:
        raise ValueError(
            f"{', '.join(packed)} describe a packed row, whose samples transformers finds from position_ids[0]: pass "
            "the collator's (4, 1, L) position_ids with them"
        )
    deltas = collated.get("rope_deltas")
    if deltas is not None:
        check_tensor(deltas, "rope_deltas", dtype="real", expected="a (B, 1) tensor of decoding deltas")
        source = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
        batch = None if source is None else source.shape[0]
        if deltas.ndim != 2 or deltas.shape[1] != 1 or (batch is not None and deltas.shape[0] != batch):
            raise ValueError(f"rope_deltas must be (B, 1) with B = {batch}, got {tuple(deltas.shape)}")
        self.rope_deltas = deltas
    return own(*args, **kwargs)


_METHODS = {
    "forward": _forward,
    "get_rope_index": _get_rope_index,
    "compute_3d_position_ids": _compute_3d_position_ids,
    "_prepare_position_ids_for_generation": _prepare_position_ids_for_generation,
}
for _function in _METHODS.values():
    _function.visionpe_patch = True  # marks the adapter's methods, see remove_position_scheme


def _validate(entry: MultimodalScheme, options: dict[str, Any], vl_model: nn.Module, family: VLMFamily) -> None:
    """The options the Qwen-VL adapter refuses (:func:`check_scheme_options`) and, for a block-mask design, an
    attention implementation that cannot take its mask."""
    check_scheme_options(entry, options)
    if entry.block_mask:
        check_attention_implementation(family.language(vl_model).config, entry.name)


def check_scheme_options(entry: MultimodalScheme, options: dict[str, Any]) -> None:
    """ValueError for design options the Qwen-VL adapter (and its collator) refuse: per-call inputs, ``layer`` and
    missing required options."""
    check_instance(entry, "entry", MultimodalScheme, expected="a MultimodalScheme registry entry")
    check_instance(options, "options", dict, expected="a dict of design options")
    per_call = [name for name in entry.call_inputs if name in options and name in (_TIME, *_BATCH_INPUTS)]
    if _TIME in per_call:
        raise ValueError(f"{_TIME} is a per-call input: pass it to forward() / generate(), not here")
    if per_call:
        raise ValueError(
            f"{', '.join(per_call)} describe one batch's tokens: pass them to the patched model's "
            "model.get_rope_index(...) (then position_ids= to forward), not to apply_position_scheme"
        )
    if entry.layer_of is not None and "layer" in options:
        raise ValueError(f"{entry.name}: layer is set per decoder layer by the adapter, got layer={options['layer']!r}")
    missing = [name for name in entry.required_options if options.get(name) is None]
    if missing:
        raise ValueError(f"apply_position_scheme({entry.name!r}) needs {', '.join(missing)}=: it has no default")


def _prepare(
    entry: MultimodalScheme, options: dict[str, Any], given: dict[str, Any], vl_model: nn.Module, family: VLMFamily
) -> Prepared:
    """The rotary (the model's RoPE scaling applied to the scheme's frequencies; PPERotary for K > 1 positions per
    token), the options checked on a trial batch and the per-layer plan (PyPE, AGE ids; CCA, PyPE masks)."""
    text_config = vl_model.config.text_config
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    try:
        rope_scaling = RopeScaling.from_rope_parameters(rope, getattr(text_config, "max_position_embeddings", None))
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"apply_position_scheme: the model's text_config.rope_parameters are not supported: {err}") from err
    head_dim, rotary_kwargs = rotary_options(entry, given, vl_model, family)
    representatives = entry.representatives(options)  # K > 1: ids (3K, B, L), each section cut into K sub-bands
    rotary_class = PPERotary if isinstance(representatives, int) and representatives > 1 else MultimodalRotary
    if rotary_class is PPERotary:
        rotary_kwargs["num_representatives"] = representatives
    rotary = rotary_class.from_scheme(
        entry.name, head_dim, base=float(rope.get("rope_theta", 10000.0)), rope_scaling=rope_scaling, **rotary_kwargs
    )
    spatial_merge_size = int(getattr(vl_model.config.vision_config, family.merge_size))
    check_design_options(entry.name, options, spatial_merge_size)
    state = _QwenState(entry, options, family, spatial_merge_size)
    try:  # per-layer ids (PyPE, AGE) and intra-block masks (CCA, PyPE)
        plan = _CollatedLayerPlan(
            entry,
            options,
            int(text_config.num_hidden_layers),
            spatial_merge_size=spatial_merge_size,
            split_videos=family.split_videos,
            takes_time=state.takes_time,
        )
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"apply_position_scheme({entry.name!r}): {err}") from err
    return Prepared(state, rotary, plan)


_ADAPTER = Adapter(ADAPTER, _validate, _prepare, _METHODS)


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
    Head-wise allocations (``mhrope``) produce per-head tables (B, H_kv, L, D); for them each attention module of
    the patched model gets a ``forward`` of its own, its class's with ``apply_rotary_pos_emb`` routing 4-D tables to
    :func:`~visionpe.multimodal.apply_multimodal_rotary`
    (:func:`~visionpe.integrations.hf.adapter.patch_rotary_function`); transformers' module and every other model
    are unchanged.


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
    return apply_scheme(_ADAPTER, model, scheme, kwargs)


def remove_position_scheme(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_position_scheme`, in place: the model runs with its own position scheme again.

    The language model's own rotary module and the class's ``get_rope_index``, ``compute_3d_position_ids`` and
    ``_prepare_position_ids_for_generation`` (of a ``*ForConditionalGeneration``) are put back (and the forwards
    replaced for per-layer ids or masks, see :func:`apply_position_scheme`), the cached
    ``rope_deltas`` are cleared and ``visionpe_scheme`` is deleted, so the logits equal the unpatched model's
    exactly. (Patched through the ``*ForConditionalGeneration`` and removed through its inner ``*Model``, the outer
    model keeps an inert ``_prepare_position_ids_for_generation`` that defers to the class's: remove through the
    model that was patched.) A model that is not patched is returned unchanged. The attention modules' ``forward``
    given for head-wise schemes are removed too.

    Args:
        model: a model (or inner ``*Model``) accepted by :func:`apply_position_scheme`.

    Returns:
        The same model.

    Example:
        >>> apply_position_scheme(model, "videorope")  # doctest: +SKIP
        >>> remove_position_scheme(model)  # doctest: +SKIP
    """
    return remove_scheme(model, ADAPTER)
