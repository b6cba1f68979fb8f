"""Hugging Face adapter: run a transformers Qwen-VL model with any visionpe multimodal scheme.

``apply_position_scheme(model, "videorope")`` swaps the two halves of the model's M-RoPE (Wang et al.,
"Qwen2-VL", arXiv 2409.12191, 2024) for a visionpe scheme: the position design (the model's
``get_rope_index``, used by ``forward`` and by ``generate``) and the frequency allocation (the language
model's rotary embedding). Decoding with a KV cache keeps working unchanged: transformers advances every
row of the ids by one per new token (``generate``) or adds the stored ``rope_deltas`` to
``cumsum(attention_mask) - 1`` (``forward`` with a cache), and visionpe returns deltas in that convention.

transformers is optional (``pip install visionpe[vlm]``); it is imported when this function is called.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch
from torch import nn

from ..multimodal.ids import get_position_ids
from ..multimodal.registry import get_multimodal_scheme
from ..multimodal.rotary import MultimodalRotary, apply_multimodal_rotary

__all__ = ["apply_position_scheme", "SUPPORTED_MODELS"]

# class name of the inner model -> transformers module that defines it
SUPPORTED_MODELS = {
    "Qwen2VLModel": "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "Qwen2_5_VLModel": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "Qwen3VLModel": "transformers.models.qwen3_vl.modeling_qwen3_vl",
}
_ROTARY_OPTIONS = ("mrope_section",)
_ALLOCATION_DEFAULTS = {"interleaved": (24, 20, 20), "chunked": (16, 24, 24), "lta": (16, 24, 24), "hope": (16, 24, 24)}


def _inner_model(model: nn.Module) -> tuple[nn.Module, str]:
    classes = {}
    for name, module_name in SUPPORTED_MODELS.items():
        try:
            classes[name] = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    for candidate in (model, getattr(model, "model", None)):
        for name, cls in classes.items():
            if isinstance(candidate, cls):
                return candidate, name
    supported = ", ".join(f"{n} (or its ForConditionalGeneration)" for n in classes)
    raise TypeError(f"apply_position_scheme supports {supported}; got {type(model).__name__}")


def _scaled_section(default: tuple[int, int, int], num_pairs: int) -> tuple[int, int, int]:
    """A (t, h, w) split of ``num_pairs`` in the proportions of ``default``, with h == w."""
    spatial = round(num_pairs * default[1] / sum(default))
    return (num_pairs - 2 * spatial, spatial, spatial)


class _HFRotary(nn.Module):
    """Drop-in for the language model's ``rotary_emb``: ``forward(x, position_ids) -> (cos, sin)`` in x's dtype."""

    def __init__(self, rotary: MultimodalRotary) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(position_ids.to(x.device), dtype=x.dtype)


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
            ``generate``.

    Returns:
        The same model; ``model.visionpe_scheme`` records the scheme.

    With ``scheme="mrope"`` on Qwen2-VL the logits equal the unpatched model's on image inputs (both
    continuation rules agree there); on videos visionpe defaults to the original Qwen2-VL rule
    (``continuation="max_plus_one"``), pass ``continuation="spatial_extent"`` for transformers 5.x's.
    Head-wise allocations (``mhrope``) produce per-head tables (B, H_kv, L, D); for them the model family's
    ``apply_rotary_pos_emb`` is replaced, once per process, by a version that routes 4-D tables to
    :func:`~visionpe.multimodal.apply_multimodal_rotary` and everything else to the original.
    """
    try:
        importlib.import_module("transformers")
    except ImportError as err:
        raise ImportError("apply_position_scheme needs transformers: pip install visionpe[vlm]") from err
    vl_model, class_name = _inner_model(model)
    entry = get_multimodal_scheme(scheme)
    design_kwargs = {k: v for k, v in kwargs.items() if k not in _ROTARY_OPTIONS}
    unknown = [k for k in design_kwargs if k not in entry.design_options()]
    if unknown:
        raise ValueError(
            f"{scheme} got unknown option(s) {unknown}; valid options: {entry.design_options() + list(_ROTARY_OPTIONS)}"
        )
    if "second_per_grid_ts" in design_kwargs:
        raise ValueError("second_per_grid_ts is a per-call input: pass it to forward() / generate(), not here")
    text_config = vl_model.config.text_config
    vision_config = vl_model.config.vision_config
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"apply_position_scheme supports rope_type 'default', the model uses {rope['rope_type']!r}")
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    num_pairs = head_dim // 2

    rotary_kwargs: dict[str, Any] = {}
    if "mrope_section" in kwargs:
        rotary_kwargs["mrope_section"] = tuple(kwargs["mrope_section"])
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
            own if fits else _scaled_section(_ALLOCATION_DEFAULTS[entry.allocation], num_pairs)
        )
    if entry.allocation == "head":
        rotary_kwargs["num_kv_heads"] = text_config.num_key_value_heads
    original_rotary = vl_model.language_model.rotary_emb
    rotary = MultimodalRotary.from_scheme(
        scheme,
        head_dim,
        base=float(rope.get("rope_theta", 10000.0)),
        attention_scaling=float(getattr(original_rotary, "attention_scaling", 1.0)),
        **rotary_kwargs,
    )
    spatial_merge_size = int(vision_config.spatial_merge_size)
    if scheme == "mrope_abs_time" and "tokens_per_second" not in design_kwargs:
        design_kwargs["tokens_per_second"] = float(getattr(vision_config, "tokens_per_second", 2))
    takes_time = "second_per_grid_ts" in entry.design_options()
    splits_videos = class_name == "Qwen3VLModel"

    def get_rope_index(
        self,
        input_ids: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if mm_token_type_ids is None:
            raise ValueError(f"visionpe scheme {scheme!r} needs mm_token_type_ids (0 text, 1 image, 2 video)")
        if splits_videos and video_grid_thw is not None:
            # Qwen3-VL frames are separate T = 1 blocks with timestamp text between them.
            video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
            video_grid_thw[:, 0] = 1
        options = dict(design_kwargs)
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

    vl_model.get_rope_index = types.MethodType(get_rope_index, vl_model)
    vl_model.language_model.rotary_emb = _HFRotary(rotary).to(original_rotary.inv_freq.device)
    vl_model.rope_deltas = None
    if rotary.per_head:
        modeling = importlib.import_module(SUPPORTED_MODELS[class_name])
        if not hasattr(modeling.apply_rotary_pos_emb, "visionpe_original"):
            modeling.apply_rotary_pos_emb = _dispatching_apply(modeling.apply_rotary_pos_emb)
    model.visionpe_scheme = scheme
    return model
