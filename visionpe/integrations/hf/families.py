"""Where each supported transformers VLM keeps what visionpe's adapters read and patch: one table, one row a family.

A row (:class:`VLMFamily`) names the inner model's class and its transformers module, the adapter that runs it, the
methods through which its position ids reach the language model (replaced per instance), where the language model,
its rotary embedding, its decoder layers and their attention live, the function with which that attention applies
(cos, sin) to the queries and keys, and the few facts about the visual layout that differ between families. The
adapters (:mod:`~visionpe.integrations.hf.qwen`, :mod:`~visionpe.integrations.hf.llava`) read everything
family-specific from here, so a new family of the same kind is a new row.

The classes are imported from transformers by name (:meth:`VLMFamily.model_class`), so a transformers without one of
them still serves the others.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...checks import check_instance

__all__ = [
    "VLMFamily",
    "FAMILIES",
    "ADAPTERS",
    "VISUAL_LAYOUTS",
    "families_of",
    "models_of",
    "find_model",
    "find_family",
    "outer_name",
]

ADAPTERS = ("qwen", "llava")  # modules of visionpe.integrations.hf that run a family
# how a 1-D RoPE family lays out the placeholder tokens of one run (see visionpe.integrations.hf.llava)
VISUAL_LAYOUTS = ("images", "tiles", "anyres")


def outer_name(inner: str) -> str:
    """``LlavaModel`` -> ``LlavaForConditionalGeneration`` (the naming every supported family follows)."""
    check_instance(inner, "inner", str, expected="a class name ending in 'Model'")
    if not inner.endswith("Model"):
        raise ValueError(f"inner must be a class name ending in 'Model', got {inner!r}")
    return inner[: -len("Model")] + "ForConditionalGeneration"


@dataclass(frozen=True)
class VLMFamily:
    """One transformers VLM family: where its ids, rotary and attention live, and what its adapter patches.

    Attributes:
        model: class name of the inner ``*Model`` (its ``*ForConditionalGeneration`` is :attr:`outer`).
        module: the transformers module that defines it.
        adapter: the module of ``visionpe.integrations.hf`` that runs it (one of :data:`ADAPTERS`).
        feature: how compatibility errors name that adapter.
        own_scheme: the visionpe scheme that gives the model's own position ids.
        patched: the methods through which the ids reach the language model, replaced per instance, with the
            arguments the adapter reads or passes by name: ``(on the outer model?, name, parameters)``. The
            installed transformers is checked against them before anything is patched.
        functions: functions of :attr:`module` that the adapter calls (checked the same way).
        language_model, rotary, layers, attention: attribute of the inner model holding the language model, of the
            language model holding its rotary embedding (``forward(x, position_ids) -> (cos, sin)``) and its decoder
            layers, and of a decoder layer holding its attention.
        rotary_function: the global of the attention's modeling module that the attention's ``forward`` calls to
            apply (cos, sin) to q and k; head-wise schemes give it (B, H_kv, L, D) tables through a per-instance
            ``forward`` (:func:`~visionpe.integrations.hf.adapter.patch_rotary_function`).
        deltas: attribute of the inner model that caches the decoding deltas of the last prompt, or None.
        section_allocation: the allocation that the language model's own ``rope_parameters["mrope_section"]`` is laid
            out for (``"chunked"``: t, h, w bands; ``"interleaved"``: Qwen3-VL's), None where it has none.
        merge_size: attribute of ``vision_config`` that gives the side of the patch merge of one visual token, or
            None where each placeholder token is one grid cell.
        split_videos: a video's frames are separate one-frame blocks with timestamp text between them (Qwen3-VL).
        visual_layout: for the 1-D RoPE adapter, how a run of placeholder tokens is cut into grids (one of
            :data:`VISUAL_LAYOUTS`: whole images of ``(image_size / patch_size)^2`` tokens, an image of tiles, or
            LLaVA-OneVision's anyres views); None for families whose processor gives the grids.
        video_tokens: whether ``config.video_token_id`` marks video placeholder tokens.
    """

    model: str
    module: str
    adapter: str
    feature: str
    own_scheme: str
    patched: tuple[tuple[bool, str, tuple[str, ...]], ...]
    functions: tuple[str, ...] = ()
    language_model: str = "language_model"
    rotary: str = "rotary_emb"
    layers: str = "layers"
    attention: str = "self_attn"
    rotary_function: str = "apply_rotary_pos_emb"
    deltas: str | None = None
    section_allocation: str | None = None
    merge_size: str | None = None
    split_videos: bool = False
    visual_layout: str | None = None
    video_tokens: bool = False

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise ValueError(f"adapter must be one of {ADAPTERS}, got {self.adapter!r}")
        if self.visual_layout is not None and self.visual_layout not in VISUAL_LAYOUTS:
            raise ValueError(f"visual_layout must be one of {VISUAL_LAYOUTS} or None, got {self.visual_layout!r}")

    @property
    def outer(self) -> str:
        """Class name of the ``*ForConditionalGeneration`` around the inner model."""
        return outer_name(self.model)

    def model_class(self) -> type | None:
        """The inner model's class from the installed transformers, None where it has none."""
        try:
            return getattr(importlib.import_module(self.module), self.model)
        except (ImportError, AttributeError):
            return None

    def language(self, vl_model: nn.Module) -> nn.Module:
        """The language model of the inner model ``vl_model``."""
        check_instance(vl_model, "vl_model", nn.Module, expected=f"a {self.model}")
        return getattr(vl_model, self.language_model)

    def attentions(self, vl_model: nn.Module) -> list[nn.Module]:
        """The attention module of every decoder layer of ``vl_model``'s language model, in layer order."""
        return [getattr(layer, self.attention) for layer in getattr(self.language(vl_model), self.layers)]

    def methods(self, model: nn.Module, vl_model: nn.Module) -> list[tuple[nn.Module, str]]:
        """(object, method name) of every method in :attr:`patched`: on ``model`` for the outer ones (skipped when
        ``model`` is the inner model ``vl_model`` itself, which has no ``generate``), else on ``vl_model``."""
        check_instance(model, "model", nn.Module, expected=f"a {self.model} or {self.outer}")
        outer = model if model is not vl_model else None
        return [(outer if on_outer else vl_model, name) for on_outer, name, _ in self.patched if not on_outer or outer]


_QWEN = "visionpe's Qwen-VL adapter"
_ROPE_1D = "visionpe's 1-D RoPE adapter (LLaVA, LLaVA-OneVision, InternVL)"
_LAYOUT = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "attention_mask")
_GENERATION_IDS = (True, "_prepare_position_ids_for_generation", ("inputs_tensor", "model_kwargs"))
# forward reaches the ids through compute_3d_position_ids and generate through the outer model's
# _prepare_position_ids_for_generation; both call get_rope_index(input_ids, mm_token_type_ids, ...)
_QWEN_PATCHED = (
    # forward takes what a collator adds beside position_ids (rope_deltas, per-layer ids and masks) and pops it
    (False, "forward", ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds")),
    (False, "get_rope_index", _LAYOUT),
    (False, "compute_3d_position_ids", ("input_ids", "inputs_embeds", *_LAYOUT[1:])),
    _GENERATION_IDS,
)
# the 1-D RoPE models take the ids as forward's position_ids; generate builds them once and then prepares each step
# (arguments passed by name: a **kwargs in transformers would swallow a renamed one, e.g. cache, silently)
_ROPE_1D_PATCHED = (
    (False, "forward", ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds")),
    _GENERATION_IDS,
    (
        True,
        "prepare_inputs_for_generation",
        ("input_ids", "next_sequence_length", "cache", "attention_mask", "inputs_embeds", "is_first_iteration"),
    ),
)
_QWEN_FAMILY = dict(
    adapter="qwen", feature=_QWEN, patched=_QWEN_PATCHED, deltas="rope_deltas", merge_size="spatial_merge_size"
)
_ROPE_1D_FAMILY = dict(adapter="llava", feature=_ROPE_1D, own_scheme="rope_1d", patched=_ROPE_1D_PATCHED)

# inner model class name -> its family, in the order the adapters list them
FAMILIES: dict[str, VLMFamily] = {
    family.model: family
    for family in (
        VLMFamily(
            "Qwen2VLModel",
            "transformers.models.qwen2_vl.modeling_qwen2_vl",
            own_scheme="mrope",
            section_allocation="chunked",
            **_QWEN_FAMILY,
        ),
        VLMFamily(
            "Qwen2_5_VLModel",
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
            own_scheme="mrope_abs_time",
            section_allocation="chunked",
            **_QWEN_FAMILY,
        ),
        VLMFamily(
            "Qwen3VLModel",
            "transformers.models.qwen3_vl.modeling_qwen3_vl",
            own_scheme="mrope_interleaved",
            section_allocation="interleaved",
            split_videos=True,
            **_QWEN_FAMILY,
        ),
        VLMFamily("LlavaModel", "transformers.models.llava.modeling_llava", visual_layout="images", **_ROPE_1D_FAMILY),
        VLMFamily(
            "LlavaOnevisionModel",
            "transformers.models.llava_onevision.modeling_llava_onevision",
            visual_layout="anyres",
            video_tokens=True,
            functions=("get_anyres_image_grid_shape", "unpad_image"),  # the anyres layout is the model's own
            **_ROPE_1D_FAMILY,
        ),
        VLMFamily(
            "InternVLModel", "transformers.models.internvl.modeling_internvl", visual_layout="tiles", **_ROPE_1D_FAMILY
        ),
    )
}


def families_of(adapter: str | None = None) -> dict[str, VLMFamily]:
    """The rows of :data:`FAMILIES` that ``adapter`` (one of :data:`ADAPTERS`) runs; every row for None."""
    if adapter is not None and adapter not in ADAPTERS:
        raise ValueError(f"adapter must be one of {ADAPTERS} or None, got {adapter!r}")
    return {name: family for name, family in FAMILIES.items() if adapter is None or family.adapter == adapter}


def models_of(adapter: str | None = None) -> dict[str, str]:
    """{inner model class name: transformers module} of the families that ``adapter`` runs (every one for None)."""
    return {name: family.module for name, family in families_of(adapter).items()}


def find_model(model: Any, table: dict[str, str] | None = None) -> tuple[nn.Module, str] | None:
    """(inner model, its class name) when ``model`` or ``model.model`` is an instance of a class of ``table``
    ({class name: transformers module}; every supported family by default; classes missing from the installed
    transformers are skipped), else None."""
    if table is None:
        table = models_of()
    check_instance(table, "table", dict, expected="a dict {class name: transformers module}")
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


def find_family(model: Any, adapter: str | None = None) -> tuple[nn.Module, VLMFamily]:
    """(inner model, its family) of ``model``, among the families that ``adapter`` runs (all for None); a TypeError
    that lists them for a model of none of them."""
    families = families_of(adapter)
    found = find_model(model, {name: family.module for name, family in families.items()})
    if found is None:
        supported = ", ".join(f"{name} (or {family.outer})" for name, family in families.items())
        raise TypeError(f"apply_position_scheme supports {supported}; got {type(model).__name__}")
    return found[0], families[found[1]]
